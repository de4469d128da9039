"""The `jspec` command line: convert | generate | bench | demo."""

from __future__ import annotations

import argparse
import sys


def _cmd_convert(args) -> int:
    from jspec.convert.hf_to_jspec import convert_checkpoint
    dst = convert_checkpoint(args.src, args.dst, force=args.force, dtype=args.dtype,
                             progress=not args.quiet)
    print(f"wrote {dst}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jspec", description="Lossless DSpark speculative "
                                     "decoding for Qwen3 in JAX")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("convert", help="Hugging Face checkpoint directory -> jspec (Orbax) directory")
    p.add_argument("src", help="Hugging Face model directory (config.json + *.safetensors)")
    p.add_argument("dst", help="output directory (must not exist unless --force)")
    p.add_argument("--force", action="store_true", help="replace an existing DST")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                   help="store weights in this dtype (default: the checkpoint's)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("jspec: interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileExistsError, FileNotFoundError, NotADirectoryError) as e:
        # ConfigError and CheckpointError are ValueErrors: one line naming the problem.
        print(f"jspec {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
