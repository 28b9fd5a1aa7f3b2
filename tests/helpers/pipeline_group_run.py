"""One stage of a pipeline group, as its own process (driven by test_pipeline_group.py).

usage: pipeline_group_run.py STAGE PP TP COORDINATOR CHECKPOINT OUT_JSON [REQUESTS_JSON]
Stage 0 serves the requests through the scheduler and writes each request's tokens to OUT_JSON.
"""

from __future__ import annotations

import json
import sys

from switchyard.service.engine.engine import Engine, EngineConfig
from switchyard.service.engine.pipeline_group import CommandChannel, LeaderEngine, follow, join
from switchyard.service.engine.request import GenerationRequest
from switchyard.service.engine.sampling import SamplingParams
from switchyard.service.engine.scheduler import Scheduler
from switchyard.service.modelspec import ServingLayout


def main() -> int:
    stage, pp, tp = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    coordinator, checkpoint, out = sys.argv[4], sys.argv[5], sys.argv[6]
    requests = json.loads(sys.argv[7]) if len(sys.argv) > 7 else []
    layout = ServingLayout(tp=tp, pp=pp, batch_slots=4, max_seq_len=64, pipeline_stage=stage, coordinator=coordinator)
    join(layout, heartbeat_timeout_s=5)
    config = EngineConfig(batch_slots=4, max_seq_len=64, step_tokens=8, block_size=8)
    engine = Engine.from_checkpoint(checkpoint, layout, config, progress=False)
    print(f"stage {stage}: {len(engine.mesh.devices.flat)} devices, ready", flush=True)
    channel = CommandChannel.open(layout)
    if stage:
        follow(engine, channel)
        return 0
    leader = LeaderEngine(engine, channel)
    sched = Scheduler(leader, max_queue=64)
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str] = {}

    def on_event(e) -> None:
        if e.token_id is not None:
            tokens.setdefault(e.request_id, []).append(e.token_id)
        if e.finish_reason:
            finish[e.request_id] = e.finish_reason

    for i, (prompt, n, temperature, top_k, top_p, seed) in enumerate(requests):
        sched.submit(GenerationRequest(f"r{i}", prompt, n, SamplingParams(temperature, top_k, top_p, seed),
                                       ignore_eos=True, on_event=on_event))
    while sched.in_flight:
        sched.step()
        if leader.broken is not None:
            print(f"stage 0: pipeline group broken: {leader.broken}", flush=True)
            return 3
    while sched.step():  # drain the last launched step
        pass
    leader.stop()
    with open(out, "w") as f:
        json.dump({"tokens": tokens, "finish": finish}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
