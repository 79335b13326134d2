"""transformers ``generate`` under the CPU-comparison protocol (see protocol.py): left-padded static batches."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/common.py

import protocol  # noqa: E402


def main() -> None:
    args = protocol.parse_args()
    import torch
    import transformers

    from common import hf_generate, load_hf_model  # the same padded greedy generate as the offline benchmark

    if args.threads:
        torch.set_num_threads(args.threads)
    workload = protocol.load_workload(args.workload)
    protocol.progress(f"loading {args.model} (bf16)")
    model = load_hf_model(Path(args.model), torch.bfloat16)
    measured = protocol.measure(lambda prompts, max_tokens: hf_generate(model, prompts, max_tokens), workload)
    protocol.write_result(args.out, "transformers", transformers.__version__, measured, threads=torch.get_num_threads())


if __name__ == "__main__":
    main()
