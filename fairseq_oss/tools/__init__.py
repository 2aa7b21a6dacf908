"""The ``fairseq-oss`` command (also ``python -m fairseq_oss``).

Owns the command line: the parser, and turning every expected failure into one line on
stderr and an exit code (1: a problem with the input or the output; 2: a usage error;
130: interrupted), never a traceback. Each subcommand is a module of this package with a
``run(args)``; torch is imported only once the arguments parse.
"""
import argparse
import errno
import sys

from fairseq_oss import __version__

EXIT_PROBLEM, EXIT_INTERRUPTED = 1, 130
WRITES = ("strip",)  # the subcommands that write a file

DESCRIPTION = """\
Look into fairseq checkpoints without loading them: what they hold, whether they are
intact, a copy without optimizer state, and what each rank would hold when oss_adam
resumes at another world size. Works on any fairseq checkpoint (oss_adam's, stock
adam's, anything torch.save wrote in its zip format), reads only what it needs, and
never runs code from the file."""

EPILOG = """\
examples:
  fairseq-oss inspect checkpoints/checkpoint_last.pt
  fairseq-oss verify checkpoints/*.pt
  fairseq-oss strip checkpoints/checkpoint_best.pt -o model.pt --dtype fp16
  fairseq-oss reshard-plan checkpoints/checkpoint_last.pt --world-size 8

'fairseq-oss COMMAND --help' tells more of each."""

FILE_HELP = "a fairseq checkpoint (.pt)"


def _command(sub, name, summary, details):
    return sub.add_parser(name, help=summary, description=f"{summary[0].upper()}{summary[1:]}. {details}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fairseq-oss", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"fairseq-oss {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = _command(sub, "inspect", "what a checkpoint holds",
                 "Model, optimizer state, training progress and who wrote it, read from the file's "
                 "pickle and directory only: memory does not grow with the file.")
    s.add_argument("file", metavar="FILE", help=FILE_HELP)
    s.add_argument("--json", action="store_true", help="print the same facts as JSON")

    s = _command(sub, "verify", "check checkpoints against their checksums",
                 "Every record, chunk by chunk: fairseq-oss's per-chunk CRC32s where the file has "
                 "them, else the zip's own CRC32 of each record. Names the first damaged record and "
                 "the tensors it holds. Exit 1 if any FILE is damaged.")
    s.add_argument("files", nargs="+", metavar="FILE", help="fairseq checkpoints (.pt)")

    s = _command(sub, "strip", "write a checkpoint without its optimizer state",
                 "For inference and fine-tuning: the same model, cfg and training history, in "
                 "fairseq-oss's checksummed format, which stock fairseq loads. Every byte copied is "
                 "checked against the source's checksums, and nothing appears under the new name "
                 "unless the whole file was written.")
    s.add_argument("file", metavar="FILE", help=FILE_HELP)
    s.add_argument("-o", "--output", metavar="OUT", help="the new file; must not exist, its directory must")
    s.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], help="cast floating-point tensors to this type")
    s.add_argument("--in-place", action="store_true", help="replace FILE (atomically) instead of writing -o OUT")

    s = _command(sub, "reshard-plan", "what each rank would hold when oss_adam resumes at a world size",
                 "From the file's index alone: each rank's share of the Adam state, what it reads at "
                 "resume, and the balance between ranks.")
    s.add_argument("file", metavar="FILE", help=FILE_HELP)
    s.add_argument("--world-size", type=int, required=True, metavar="M", help="the number of data-parallel ranks")
    s.add_argument("--bucket-mb", type=float, default=32.0, metavar="MB",
                   help="oss_adam's --oss-bucket-mb (default 32)")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from fairseq_oss.checkpoint.format import CheckpointError  # torch: only once the arguments are fine

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
        print(f"{name}: interrupted{_NOTHING_WRITTEN if args.command in WRITES else ''}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as e:
        what = "no space left on the device" if e.errno == errno.ENOSPC else (e.strerror or str(e))
        where = f" ({e.filename})" if e.filename else ""
        print(f"{name}: {what}{where}{_NOTHING_WRITTEN if args.command in WRITES else ''}", file=sys.stderr)
    return EXIT_PROBLEM


_NOTHING_WRITTEN = "; nothing was written under a final name"
