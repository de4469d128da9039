"""Tokens per verify step of the shipped stand-in pair (or any target + drafters) through the
engine, on the humaneval + mbpp first turns at T = 1 and greedy, greedy outputs checked against
stock: the measurement scripts/train_standin.py makes right after training, for the weights as
packed (int8 x bf16 scales).

  python scripts/standin_acceptance.py --prompts-dir ../shared/data/prompts --limit 100 --out eval.json
  python scripts/standin_acceptance.py --target DIR --drafter dspark=DIR --drafter dflash=DIR ...
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="standin", help="target directory or stand-in name")
    ap.add_argument("--drafter", action="append", default=[],
                    help="NAME=DIR (repeatable; default dspark=standin-dspark and dflash=standin-dflash)")
    ap.add_argument("--prompts-dir", required=True, help="directory with humaneval.jsonl and mbpp.jsonl")
    ap.add_argument("--limit", type=int, default=100, help="first N prompts of each set (0 = all)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--samplings", default="t1,greedy", help="comma list of t1, greedy (default both)")
    ap.add_argument("--out", required=True, help="JSON record to write")
    args = ap.parse_args(argv)

    from jspec.loading import check_model_dir
    drafters = dict(d.split("=", 1) for d in args.drafter) or {"dspark": "standin-dspark",
                                                               "dflash": "standin-dflash"}
    spec = importlib.util.spec_from_file_location("train_standin", ROOT / "scripts" / "train_standin.py")
    ts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ts)
    try:  # refused before any model loads, under this script's own option name
        ts.eval_samplings(args.samplings, flag="--samplings")
    except ValueError as e:
        ap.error(str(e))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    eval_args = ts.eval_args(eval_prompts_dir=args.prompts_dir, eval_limit=args.limit,
                             eval_max_tokens=args.max_tokens, eval_samplings=args.samplings)
    result = ts.stage_engine_eval(eval_args, Path(args.out).parent, check_model_dir(args.target),
                                  {k: check_model_dir(v) for k, v in drafters.items()}, Path(args.out))
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
