"""``switchyard`` command dispatcher.

Each subcommand lives with the part it belongs to, in a module that exposes
``add_arguments(parser)`` and ``run(args) -> int``. Those modules keep heavy imports (JAX,
gRPC, kopf) inside ``run`` so that ``switchyard --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from switchyard.cli.usage import EXIT_USAGE, UsageError

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("switchyard.cli.demo", "generate text with the embedded tiny model, printing per-token timings"),
    "make-checkpoint": ("switchyard.cli.make_checkpoint",
                        "write a random-weight Hugging Face checkpoint (with a tokenizer)"),
    "serve": ("switchyard.cli.serve", "run the gRPC decode service"),
    "generate": ("switchyard.cli.generate", "stream a generation from a running service"),
    "trace": ("switchyard.cli.trace", "inspect per-token traces"),
    "plan": ("switchyard.cli.plan", "choose a parallel layout for a model on a set of nodes"),
    "operator": ("switchyard.cli.operator", "run the Kubernetes operator"),
}


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Each option's help ends with its default, where it has one worth saying (not None or off) and
    the help does not already say it; defaults read from ``SWITCHYARD_*`` variables show as read."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (default is None or default is False or default in ("", [], argparse.SUPPRESS) or "default" in text
                or not action.option_strings or text == argparse.SUPPRESS):
            return action.help
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="switchyard", description="LLM decode service for HGX GPU nodes")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name != module_name:
                raise
            continue  # a part not installed in this image (the operator image has no JAX engine)
        command = sub.add_parser(name, help=help_text, description=help_text, formatter_class=DefaultsHelpFormatter)
        module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


# A module only an optional part needs -> the extra that installs it.
EXTRAS = {
    **dict.fromkeys(("jax", "jaxlib", "ml_dtypes", "numpy", "safetensors", "tokenizers", "tqdm", "grpc", "grpc_health",
                     "grpc_reflection", "google", "opentelemetry", "matplotlib"), "serve"),
    "kopf": "operator", "kubernetes": "operator", "torch": "dev", "transformers": "dev",
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return EXIT_USAGE
    command = f"switchyard {args.command}"
    try:
        return int(args._run(args) or 0)
    except UsageError as err:
        return _fail(f"{command}: error: {err}")
    except ModuleNotFoundError as err:
        root = (err.name or "").partition(".")[0]
        if root not in EXTRAS:
            raise
        extra = EXTRAS[root]
        return _fail(f"{command}: error: needs the {extra!r} extra (pip install 'switchyard[{extra}]'); "
                     f"module {root!r} is not installed")
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError) as err:
        if err.filename is None:
            raise
        return _fail(f"{command}: error: {err.strerror}: {err.filename}")
    except BrokenPipeError:
        # The reader went away (`| head`): say nothing more, and keep Python from complaining at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        return 130


def _fail(message: str) -> int:
    print(message, file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
