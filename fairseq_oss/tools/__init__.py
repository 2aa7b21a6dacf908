"""The ``fairseq-oss`` command (also ``python -m fairseq_oss``): inspect, verify, strip
and reshard-plan checkpoints without loading them whole. One module per subcommand; this
one parses arguments and turns every expected failure into a message and an exit code
(1: a problem with the input or the output; 2: a usage error; 130: interrupted), never
a traceback."""
import argparse
import errno
import sys

from fairseq_oss import __version__

EXIT_PROBLEM, EXIT_INTERRUPTED = 1, 130


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fairseq-oss", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"fairseq-oss {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("inspect", help="what a checkpoint holds (reads its pickle and index only)")
    s.add_argument("file")
    s.add_argument("--json", action="store_true", help="machine-readable output")

    s = sub.add_parser("verify", help="check every record against its checksums, chunk by chunk")
    s.add_argument("files", nargs="+", metavar="FILE")

    s = sub.add_parser("strip", help="the checkpoint without optimizer state (optionally cast)")
    s.add_argument("file")
    s.add_argument("-o", "--output", help="the new file (must not exist)")
    s.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], help="cast floating-point tensors")
    s.add_argument("--in-place", action="store_true", help="replace FILE (atomically) instead of writing -o OUT")

    s = sub.add_parser("reshard-plan", help="what each of M ranks would hold and read when resuming")
    s.add_argument("file")
    s.add_argument("--world-size", type=int, required=True)
    s.add_argument("--bucket-mb", type=float, default=32.0, help="oss_adam's --oss-bucket-mb (default 32)")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from fairseq_oss.checkpoint_format import CheckpointError  # torch: only once the arguments are fine

    name = f"fairseq-oss {args.command}"
    try:
        if args.command == "inspect":
            from fairseq_oss.tools.inspect_checkpoint import run
        elif args.command == "verify":
            from fairseq_oss.tools.verify import run
        elif args.command == "strip":
            from fairseq_oss.tools.strip import run
        else:
            from fairseq_oss.tools.reshard_plan import run
        return run(args)
    except CheckpointError as e:
        print(f"{name}: {e}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"{name}: interrupted; nothing was written under a final name", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as e:
        what = "no space left on the device" if e.errno == errno.ENOSPC else (e.strerror or str(e))
        where = f" ({e.filename})" if e.filename else ""
        print(f"{name}: {what}{where}; nothing was written under a final name", file=sys.stderr)
    return EXIT_PROBLEM
