"""Does sampling the drafter at another temperature raise acceptance? A probe, not a feature.

The drafter's corrected logits are divided by --draft-temperature before the request's own
processing (jspec.spec_steps.draft_sample is patched in this process only). The rejection sampler
still receives the law each draft was drawn from, so the output law is the target's at any value;
only tau can move. One temperature per process: compiled programs are reused across LLM objects
in one process, so a second temperature in the same process would not retrace the patch.

  python scripts/draft_temperature_probe.py --prompts-dir ../shared/data/prompts --limit 10 \\
      --draft-temperature 0.8 --out dt08.json
  python -c "import json, sys; sys.path.insert(0, 'scripts'); from compare_drafters import \\
      paired_tau_ratio as r; a, b = (json.load(open(f))['per_request'] for f in sys.argv[1:]); \\
      print(r(a['tokens'], a['steps'], b['tokens'], b['steps']))" dt08.json dt10.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    from verify_gate_acceptance import add_t1_probe_arguments, code_first_turns, generate_t1, t1_record
    add_t1_probe_arguments(ap)
    ap.add_argument("--draft-temperature", type=float, required=True)
    args = ap.parse_args(argv)
    if args.draft_temperature <= 0:
        ap.error(f"--draft-temperature must be > 0, got {args.draft_temperature}")

    import jspec.spec_steps as spec_steps
    from jspec import LLM

    base = spec_steps.draft_sample
    spec_steps.draft_sample = lambda logits, arrays, positions, round_start=None: base(
        logits / args.draft_temperature, arrays, positions, round_start)

    prompts = code_first_turns(args.prompts_dir, args.limit)
    llm = LLM(args.target, draft=args.draft, max_lanes=8)
    t = time.time()
    reqs = generate_t1(llm, prompts, args.max_tokens)
    rec = {**t1_record(args, prompts, reqs), "draft_temperature": args.draft_temperature,
           "wall_s": time.time() - t}
    Path(args.out).write_text(json.dumps(rec, indent=1))
    print(json.dumps({k: v for k, v in rec.items() if k != "per_request"}))
    return rec


if __name__ == "__main__":
    main()
