#!/usr/bin/env bash
# GPU check of the trtllm backend, in one run of under 8 minutes.
#
# On a machine with an NVIDIA GPU and TensorRT-LLM (e.g. inside the docker/Dockerfile.trtllm
# image, or the repo checked out in nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc13):
#   1. builds a tiny random-weight Llama with transformers (vocab 512, 2 layers);
#   2. starts one prefill and one decode worker on `--engine-backend trtllm` (GPUs 0 and 1,
#      or both on GPU 0 when there is one), KV moving through TensorRT-LLM's cache transceiver;
#   3. runs 10 disaggregated (remote prefill) and 10 local requests, greedy, and checks that
#      every remote answer equals the local one token for token;
#   4. prints PASS or FAIL with TTFT and decode tokens/s of each path; exits 1 on FAIL.
# Without a GPU or without TensorRT-LLM it says so and exits 0: nothing was checked.
#
#   bash scripts/gpu_check.sh            (from the repository root, or /opt/pdmesh in the image)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: SKIPPED - no NVIDIA GPU here (nvidia-smi missing or failing); nothing was checked"
    exit 0
fi
if ! TRT_VERSION=$("$PY" -c "import tensorrt_llm; print(tensorrt_llm.__version__)" 2>/dev/null | tail -1); then
    echo "gpu_check: SKIPPED - TensorRT-LLM is not importable by $PY; nothing was checked"
    exit 0
fi
echo "gpu_check: tensorrt_llm $TRT_VERSION on:"
nvidia-smi -L

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout --signal=TERM 450 "$PY" - <<'EOF'
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from pdmesh.launcher import Launcher, ServiceSpec, flags
from pdmesh.v1 import decode_pb2, decode_pb2_grpc

N, MAX_TOKENS = 10, 32
work = Path(tempfile.mkdtemp(prefix="pdmesh-gpu-check-"))


def tiny_llama(folder: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                 bos_token_id=0, eos_token_id=1)
    torch.manual_seed(1234)
    model = LlamaForCausalLM(LlamaConfig(**sizes)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    vocab = {"<s>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, 512)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    return folder


listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
gpus = sum(1 for line in listing.splitlines() if line.startswith("GPU "))
prefill_gpu, decode_gpu = ("0", "1") if gpus >= 2 else ("0", "0")
model = tiny_llama(work / "tiny-llama")
print(f"gpu_check: model {model}, prefill on GPU {prefill_gpu}, decode on GPU {decode_gpu}", flush=True)
engine = flags(engine_backend="trtllm", engine_model_path=model, engine_device="cuda", engine_num_blocks=256)
launcher = Launcher(work)
failures = []
try:
    prefill = launcher.start(ServiceSpec("prefill", "services.prefill.main", flags(worker_id="prefill") + engine,
                                         env={"CUDA_VISIBLE_DEVICES": prefill_gpu}, ready_service="pdmesh.v1.PrefillService"))
    launcher.wait_ready(prefill, timeout_s=240)
    decode = launcher.start(ServiceSpec("decode", "services.decode.main",
                                        flags(worker_id="decode", prefill_workers=[prefill.address]) + engine,
                                        env={"CUDA_VISIBLE_DEVICES": decode_gpu}, ready_service="pdmesh.v1.DecodeService"))
    launcher.wait_ready(decode, timeout_s=240)
    stub = decode_pb2_grpc.DecodeServiceStub(grpc.insecure_channel(decode.address))

    def run(prompt, rid, mode):
        req = decode_pb2.DecodeServiceGenerateRequest(request_id=rid, prompt_token_ids=prompt, disagg_mode=mode)
        req.sampling.max_tokens = MAX_TOKENS
        req.sampling.ignore_eos = True
        t0, first, tokens, final = time.monotonic(), None, [], None
        for msg in stub.Generate(req, timeout=60):
            if msg.HasField("tokens"):
                first = first or time.monotonic()
                tokens += msg.tokens.token_ids
            else:
                final = msg.final
        end = time.monotonic()
        rate = (len(tokens) - 1) / (end - first) if first and end > first and len(tokens) > 1 else 0.0
        return tokens, final, (first or end) - t0, rate

    import random
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 512) for _ in range(rng.choice([200, 400, 600]))] for _ in range(N)]
    results = {}
    # Local first, so both paths prefill cold caches (each worker sees each prompt first once).
    for path, mode in (("local", decode_pb2.DISAGG_MODE_LOCAL), ("remote", decode_pb2.DISAGG_MODE_REMOTE)):
        results[path] = [run(p, f"{path}-{i}", mode) for i, p in enumerate(prompts)]
        wrong = [r[1].prefill_path for r in results[path] if r[1].prefill_path != path]
        if wrong:
            failures.append(f"{len(wrong)} {path} requests took another path: {wrong}")
        ttft = [r[2] * 1000 for r in results[path]]
        rate = [r[3] for r in results[path]]
        print(f"gpu_check: {path:6s} x{N}: TTFT median {statistics.median(ttft):.1f} ms "
              f"(max {max(ttft):.1f}), decode {statistics.median(rate):.0f} tokens/s median", flush=True)
    for i, (r, l) in enumerate(zip(results["remote"], results["local"])):
        if r[0] != l[0]:
            failures.append(f"prompt {i}: remote {r[0][:8]}... != local {l[0][:8]}...")
        if len(l[0]) != MAX_TOKENS:
            failures.append(f"prompt {i}: {len(l[0])} tokens, expected {MAX_TOKENS}")
except Exception as e:  # the check's own report: any failure to run is a FAIL with its reason
    failures.append(f"{type(e).__name__}: {e}")
    for svc in launcher.services:
        print(f"--- {svc.spec.name} log tail ---\n{svc.log_tail(40)}")
finally:
    launcher.close()
if failures:
    print("gpu_check: FAIL\n  " + "\n  ".join(failures))
    sys.exit(1)
print(f"gpu_check: PASS - {N} disaggregated and {N} local requests, identical tokens")
EOF
