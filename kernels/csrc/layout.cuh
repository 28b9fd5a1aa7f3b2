// Where each algorithm keeps its data inside a GPU's workspace. Offsets are the same on every GPU,
// so a peer's buffer is `Peers::data[peer] + offset`.
#pragma once
#include <stdint.h>

namespace switchyard {

struct Layout {
  // One-shot (and fused): 2 halves x world slots x oneshot_slot bytes. Launch `epoch` uses half
  // epoch & 1 (see lamport.cuh for why two halves are needed and enough). Empty words hold
  // all ones (lamport.cuh): filled so at init and at reset.
  int64_t oneshot_off;
  int64_t oneshot_slot;   // bytes per slot = the largest one-shot message per rank
  // Two-shot: scatter area [world][slice] and gather area [world][slice], slice packs each.
  int64_t scatter_off;
  int64_t gather_off;
  int64_t twoshot_bytes;  // the largest two-shot message per rank
};

}  // namespace switchyard
