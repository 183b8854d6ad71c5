"""Generate with a local Hugging Face MoE model whose experts run on kt_kernel (transformers >= 5).

    python examples/transformers_generate.py MODEL_DIR [--format BF16] [--prompt TEXT]
        [--max-new-tokens 32] [--threads N]

Loads MODEL_DIR with ``experts_implementation="kt_kernel"``, packs the experts (timed apart: it is
done once, at each experts module's first call), generates greedily and prints the output and the
prefill and decode speeds in tokens/s. A directory without a tokenizer gets random prompt ids and
prints token ids (it says so).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

import kt_kernel.integrations.transformers as kt_transformers

#: Prompt length when the directory has no tokenizer.
RANDOM_PROMPT_TOKENS = 16
#: Files one of which a directory with a tokenizer holds (AutoTokenizer builds an empty tokenizer from
#: the model's config where there are none).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class TokenClock(BaseStreamer):
    """When generate hands over the prompt and then each new token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def load_tokenizer(model_dir: str):
    """The directory's tokenizer, or None where it has none."""
    if not any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(model_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_dir", help="a local Hugging Face model directory")
    parser.add_argument(
        "--format", default="BF16", help="kt_kernel weight format: a name in kt_kernel.formats.FORMATS"
    )
    parser.add_argument("--prompt", default="The capital of France is", help="the prompt (with a tokenizer)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--threads", type=int, default=None, help="worker threads (default: every usable CPU)"
    )
    args = parser.parse_args()

    kt_transformers.configure(weight_format=args.format, cpuinfer_threads=args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, experts_implementation="kt_kernel").eval()
    tokenizer = load_tokenizer(args.model_dir)
    if tokenizer is None:
        vocab = model.config.get_text_config().vocab_size
        generator = torch.Generator().manual_seed(0)
        input_ids = torch.randint(0, vocab, (1, RANDOM_PROMPT_TOKENS), generator=generator)
        print(f"{args.model_dir} has no tokenizer: prompting with {RANDOM_PROMPT_TOKENS} random token ids")
    else:
        input_ids = tokenizer(args.prompt, return_tensors="pt").input_ids

    with torch.inference_mode():
        start = time.perf_counter()
        model(input_ids[:, :1])  # packs every experts module
        print(f"experts packed as {args.format} in {time.perf_counter() - start:.2f} s")
        clock = TokenClock()
        # min_new_tokens: an end-of-sequence token must not cut the timed decode short.
        output = model.generate(
            input_ids,
            max_new_tokens=args.max_new_tokens,
            min_new_tokens=args.max_new_tokens,
            do_sample=False,
            streamer=clock,
        )
    new_ids = output[0, input_ids.shape[1] :]
    print(tokenizer.decode(new_ids) if tokenizer is not None else f"new token ids: {new_ids.tolist()}")

    prompt_at, first_at, last_at = clock.times[0], clock.times[1], clock.times[-1]
    prefill, prompt_tokens = first_at - prompt_at, input_ids.shape[1]
    print(f"prefill: {prompt_tokens} tokens in {prefill:.3f} s, {prompt_tokens / prefill:.1f} tokens/s")
    decoded = len(clock.times) - 2  # tokens after the first, which came with the prefill
    if decoded > 0:
        decode = last_at - first_at
        print(f"decode: {decoded} tokens in {decode:.3f} s, {decoded / decode:.1f} tokens/s")


if __name__ == "__main__":
    main()
