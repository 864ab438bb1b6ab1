"""Lightning against attention on the GPU: forward + backward of one layer each (d=2048, 16 x 128
heads, 8 KV heads, batch 1, bf16) at 4K / 16K / 64K tokens. The kernels' correctness against their
torch references is tests/test_fla_kernels_gpu.py (``bash bench/gpu.sh cuda``).

    python bench/bench_lightning.py               # on a GPU: writes bench/results/lightning.json
    python bench/bench_lightning.py --cpu-smoke   # tiny shapes on CPU (checks the script)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import log, print_table, time_cuda, write_result  # noqa: E402
from halo_dist.models.hypenet import HypeNetConfig  # noqa: E402
from halo_dist.models.hypenet.attention_hypenet import HypeNetAttention  # noqa: E402
from halo_dist.models.hypenet.layers_hypenet import SequenceInfo  # noqa: E402
from halo_dist.models.hypenet.rnn_hypenet import LightningMixer  # noqa: E402


def layer_timings(device, lengths, d=2048, H=16, Hkv=8, D=128):
    cfg = HypeNetConfig(hidden_size=d, num_attention_heads=H, num_key_value_heads=Hkv, head_dim=D,
                        num_hidden_layers=2, mixer_types=["attention", "lightning"])
    rows = []
    for T in lengths:
        row = {"tokens": T}
        for name, cls in (("lightning", LightningMixer), ("attention", HypeNetAttention)):
            layer = cls(cfg, 0).to(device=device,
                                   dtype=torch.bfloat16 if device == "cuda" else torch.float32)
            x = torch.randn(1, T, d, device=device, dtype=next(layer.parameters()).dtype,
                            requires_grad=True)
            info = SequenceInfo(position_ids=torch.arange(T, device=device)[None])

            def step(layer=layer, x=x):  # bound now: the loop deletes both before the next size
                layer(x, info).sum().backward()

            row[f"{name}_ms"] = time_cuda(step, warmup=2, iters=5)
            log(f"timed {name} at T={T}: {row[f'{name}_ms']:.2f} ms")
            del layer, x
            if device == "cuda":
                torch.cuda.empty_cache()
        row["attn/lightning"] = row["attention_ms"] / row["lightning_ms"]
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny shapes on CPU: checks the script")
    ap.add_argument("--lengths", default="4096,16384,65536")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = "cpu" if args.cpu_smoke or not torch.cuda.is_available() else "cuda"
    lengths = [64, 256] if device == "cpu" else [int(t) for t in args.lengths.split(",")]
    shapes = dict(d=2048, H=16, Hkv=8, D=128) if device == "cuda" else dict(d=128, H=4, Hkv=2, D=32)
    result = {"layer_timing": []}
    name = "lightning" if device == "cuda" else "lightning_cpu_smoke"
    for T in lengths:  # saved after every length: a run cut short keeps its numbers
        result["layer_timing"] += layer_timings(device, [T], **shapes)
        path = write_result(name, result, out=args.out)
    print_table(result["layer_timing"], "forward+backward of one layer (ms), batch 1")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
