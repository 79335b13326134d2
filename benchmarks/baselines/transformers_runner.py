"""transformers ``generate`` under the CPU-comparison protocol (see protocol.py): left-padded static batches."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import protocol  # noqa: E402


def main() -> None:
    args = protocol.parse_args()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    workload = protocol.load_workload(args.workload)
    protocol.progress(f"loading {args.model} (bf16)")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()
    pad_id = 0

    @torch.inference_mode()
    def generate(prompts: list[list[int]], max_tokens: int) -> None:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
        assert out.shape[1] == width + max_tokens

    measured = protocol.measure(generate, workload)
    protocol.write_result(args.out, "transformers", transformers.__version__, measured, threads=torch.get_num_threads())


if __name__ == "__main__":
    main()
