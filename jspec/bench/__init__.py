"""`jspec bench`: SpecScore and the lossless gate (shared/protocol.md).

  workloads.py  solo / team / busy: prompts, seeds, pool sizing, alternating timed passes
  gate.py       the lossless gate's statistics and checks (pure numpy, unit-tested)
  report.py     the JSON record, the markdown table, the PNG chart
  run.py        orchestration and the CLI entry (`add_bench_parser`, `cmd_bench`)
  peer.py       the transformers + PyTorch peer, run in a subprocess
"""
