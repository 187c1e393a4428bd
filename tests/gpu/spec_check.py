"""A verify step on a GPU against plain decode steps (speculative decoding, issue 43).

Greedy: prefill a prompt, decode N tokens one per step (the reference), then on a fresh
KV cache prefill again and send one verify step whose rows are the first sampled token and
the reference's next tokens: each row's sample must be the reference's token after it,
and its log-probability the reference's (bf16 tolerance). With CUDA graphs and eager.

    python tests/gpu/spec_check.py MODEL_DIR [N [DEVICE [PROMPT_LEN [MAX_MODEL_LEN]]]]
"""
from __future__ import annotations

import sys

import numpy as np

from nanoserve.v1 import worker_pb2
from worker_service.model_runner import ModelRunner, RunnerConfig

BLOCK = 256


def prefill(runner: ModelRunner, prompt: list[int], step_id: int) -> int:
    req = worker_pb2.StepRequest(step_id=step_id)
    w = req.seqs.add(seq_id=1, num_tokens=len(prompt), start_pos=0, reset_block_table=True,
                     sample=True, block_table_i32=np.arange(2, dtype="<i4").tobytes())
    w.sampling.temperature = 0.0
    w.sampling.logprobs = True
    req.token_ids_i32 = np.array(prompt, "<i4").tobytes()
    return int(np.frombuffer(runner.step(req).sampled_token_ids_i32, "<i4")[0])


def decode(runner: ModelRunner, tokens: list[int], step_id: int, verify: bool):
    req = worker_pb2.StepRequest(step_id=step_id)
    req.decode.seq_ids_u64 = np.array([1], "<u8").tobytes()
    req.decode.token_ids_i32 = np.array(tokens, "<i4").tobytes()
    if len(tokens) > 1:
        req.decode.num_tokens_i32 = np.array([len(tokens)], "<i4").tobytes()
        if verify:
            req.decode.num_samples_i32 = np.array([len(tokens)], "<i4").tobytes()
    resp = runner.step(req)
    return (np.frombuffer(resp.sampled_token_ids_i32, "<i4").tolist(),
            np.frombuffer(resp.logprobs_f32, "<f4").tolist())


def main() -> int:
    model, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8
    device = sys.argv[3] if len(sys.argv) > 3 else "cuda"
    plen = int(sys.argv[4]) if len(sys.argv) > 4 else 256   # 256: the verify rows open a block
    max_len = int(sys.argv[5]) if len(sys.argv) > 5 else 4096
    prompt = [(7 * i + 3) % 300 for i in range(plen)]
    bad = 0
    for eager in (False, True):
        runner = ModelRunner(RunnerConfig(model_dir=model, device=device, max_model_len=max_len,
                                          enforce_eager=eager))
        runner.init_kv(8, BLOCK)
        t0 = prefill(runner, prompt, 1)
        ref, ref_lp = [t0], []
        for i in range(n):
            (t,), (lp,) = decode(runner, [ref[-1]], 2 + i, verify=False)
            ref.append(t)
            ref_lp.append(lp)
        runner.init_kv(8, BLOCK)
        assert prefill(runner, prompt, 100) == t0
        got, lps = decode(runner, ref[:n], 101, verify=True)
        same = got == ref[1:n + 1]
        dlp = max(abs(a - b) for a, b in zip(lps, ref_lp))
        print(f"{'eager' if eager else 'graphs'}: verify rows {got}\n   plain steps {ref[1:n + 1]}"
              f"   equal {same}, max |logprob diff| {dlp:.4f}")
        bad += not same
        del runner
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
