"""Run lm-evaluation-harness (``lm_eval``) offline against an OpenAI-compatible ``/v1/completions`` and read back
its per-item loglikelihoods; the reference the test compares them with (transformers, fp32).

lm-eval's ``local-completions`` model scores a loglikelihood request ``(context, continuation)`` with one call:
``prompt`` = the token ids of context + continuation (tokenized here with the model's own Hugging Face tokenizer,
BOS first with ``add_bos_token=True``), ``echo: true``, ``logprobs: 1``, ``max_tokens: 1``, ``temperature: 0``; it
sums ``choices[0].logprobs.token_logprobs[ctxlen:-1]`` (the continuation's prompt logprobs; the last entry is the
one generated token) and calls the answer greedy when each continuation token's logprob is the largest value in its
``top_logprobs`` dict. The task's data (``tests/data/lm_eval``) ships with the repository: nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
TASK_DIR = REPO / "tests" / "data" / "lm_eval"
TASK = "splitserve_tinystories_mc"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}


@dataclass(frozen=True)
class Sample:
    """One scored (context, continuation) pair as lm-eval logged it: ``loglikelihood`` in nats (natural log)."""

    doc_id: int
    context: str
    continuation: str
    loglikelihood: float
    is_greedy: bool


def run_lm_eval(base_url: str, model_name: str, tokenizer_path: Path, out_dir: Path, timeout_s: float = 600) -> tuple[str, list[Sample], dict]:
    """Run ``python -m lm_eval`` (model ``local-completions``) on the shipped task against ``base_url`` (the server's
    root, e.g. ``http://127.0.0.1:8000``), fully offline; returns (what lm-eval printed, the logged samples, the
    results JSON). Raises RuntimeError (with the end of lm-eval's output) when lm-eval fails."""
    model_args = ",".join([
        f"base_url={base_url}/v1/completions", f"model={model_name}", f"tokenizer={tokenizer_path}",
        "tokenizer_backend=huggingface", "tokenized_requests=True", "add_bos_token=True", "max_length=512",
        "num_concurrent=1", "max_retries=1", "timeout=60",
    ])
    argv = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
            "--tasks", TASK, "--include_path", str(TASK_DIR), "--batch_size", "1", "--log_samples",
            "--output_path", str(out_dir)]
    env = {**os.environ, **OFFLINE_ENV, "OPENAI_API_KEY": "unused"}
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    printed = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"lm_eval exited with {proc.returncode}:\n{printed[-6000:]}")
    (samples_file,) = out_dir.rglob(f"samples_{TASK}_*.jsonl")
    (results_file,) = out_dir.rglob("results_*.json")
    samples = []
    for line in samples_file.read_text().splitlines():
        doc = json.loads(line)
        for args, resp in zip(doc["arguments"].values(), doc["resps"]):
            loglikelihood, is_greedy = resp[0]  # logged as strings: "-3.25", "False"
            samples.append(Sample(doc["doc_id"], args["arg_0"], args["arg_1"], float(loglikelihood), str(is_greedy) == "True"))
    return printed, samples, json.loads(results_file.read_text())


class Reference:
    """Loglikelihoods of continuations under the Hugging Face model in fp32, tokenized exactly as lm-eval's
    ``local-completions`` tokenizes (``TemplateLM._encode_pair`` with ``add_bos_token=True``)."""

    def __init__(self, model_path: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids with BOS first, continuation ids): trailing spaces of the context move to the continuation,
        the whole text is encoded once and split at the context's length, as lm-eval does."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.tok(context + continuation).input_ids
        ctx = self.tok(context).input_ids
        return ctx, whole[len(ctx):]

    def splits_cleanly(self, context: str, continuation: str) -> bool:
        """Whether the context's tokens are a prefix of the whole text's and the continuation has at least one
        token (else lm-eval scores a piece of the context, or nothing)."""
        ctx, cont = self.encode_pair(context, continuation)
        return bool(cont) and self.tok(context + continuation).input_ids[:len(ctx)] == ctx

    def loglikelihood(self, context: str, continuation: str) -> tuple[float, bool]:
        """(sum over continuation tokens of log_softmax(logits) at the token, in nats; whether every continuation
        token is the argmax)."""
        ctx, cont = self.encode_pair(context, continuation)
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            logprobs = torch.log_softmax(self.model(ids).logits[0].float(), dim=-1)
        rows = logprobs[len(ctx) - 1: len(ctx) + len(cont) - 1]
        target = torch.tensor(cont)
        total = rows.gather(1, target[:, None]).sum().item()
        greedy = bool((rows.argmax(dim=-1) == target).all())
        return total, greedy
