"""Manual check of the compiled kernels on a CUDA GPU (not collected by pytest).

The pytest suite runs the kernels in Triton's CPU interpreter; this script runs the
real compiled kernels: bit-exactness of the pack ops (fp16 and bf16), decode
attention against the float32 reference, opcheck, torch.compile and CUDA-graph
capture, then decode timings against SDPA over an unquantized 16-bit cache.

    python tests/kernels/gpu_check.py [--quick]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

from pnmix_patch.kernels.decode_attention import decode_attention, decode_attention_reference
from pnmix_patch.kernels.pack_keys import pack_keys
from pnmix_patch.kernels.pack_values import pack_values
from pnmix_patch.quantize import channel_order, quantize_keys, quantize_values

PRESETS = {  # name: (pairs fraction, G, b_H, b_L)
    "pnmix-1": (0.5, 128, 3, 1),
    "pnmix-2": (0.4, 64, 3, 1),
    "kivi-2": (1.0, 128, 2, 2),
    "r0": (0.0, 64, 3, 1),
}


def random_order(batch, heads, head_dim, num_high, device):
    mask = torch.rand(batch, heads, head_dim, device=device).argsort(-1) < num_high
    return channel_order(mask)


def same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


def check_pack(device):
    for dtype in (torch.float16, torch.bfloat16):
        for head_dim in (64, 128):
            for name, (ratio, group, bits_high, bits_low) in PRESETS.items():
                num_high = 2 * round(ratio * head_dim / 2)
                keys = torch.randn(3, 4, 4 * group, head_dim, device=device) * torch.rand(head_dim, device=device) * 5
                keys = keys.to(dtype)
                keys[0, 0, 5, 3] = float("inf")
                keys[1, 2, 0, :] = 0.5  # constant channels
                order = random_order(3, 4, head_dim, num_high, device)
                mask = torch.zeros_like(order, dtype=torch.bool).scatter_(-1, order[..., :num_high], True)
                got = pack_keys(keys, order, num_high, group, bits_high, bits_low, True)
                want = quantize_keys(keys.cpu(), mask.cpu(), num_high, group, bits_high, bits_low, True)
                ok = all(same(g.cpu(), w) for g, w in zip(got, want))
                values = torch.randn(3, 4, 200, head_dim, device=device).to(dtype)
                got_v = pack_values(values, 2, head_dim, True)
                want_v = quantize_values(values.cpu(), 2, head_dim, True)
                ok_v = all(same(g.cpu(), w) for g, w in zip(got_v, want_v))
                print(f"pack {str(dtype):15s} D={head_dim:3d} {name:8s} keys exact={ok} values exact={ok_v}")
                assert ok and ok_v


def make_cache(batch, heads, ratio, head_dim, preset, cap, sinks, residual, dtype, device, lengths=None):
    pair_ratio, group, bits_high, bits_low = PRESETS[preset]
    num_high = 2 * round(pair_ratio * head_dim / 2)
    order = random_order(batch, heads, head_dim, num_high, device)
    mask = torch.zeros_like(order, dtype=torch.bool).scatter_(-1, order[..., :num_high], True)
    keys = torch.randn(batch, heads, cap * group, head_dim, device=device, dtype=dtype)
    codes = quantize_keys(keys, mask, num_high, group, bits_high, bits_low, True)
    vcodes = quantize_values(torch.randn_like(keys), 2, head_dim, True)
    if lengths is None:
        lengths = (
            torch.randint(0, sinks + 1, (batch,)),
            torch.randint(0, cap + 1, (batch,)),
            torch.randint(1, residual + 1, (batch,)),
        )
    sink_len, num_groups, residual_len = (x.to(device=device, dtype=torch.int32) for x in lengths)

    def dense(n):
        return torch.randn(batch, heads, n, head_dim, device=device, dtype=dtype)

    query = torch.randn(batch, heads * ratio, head_dim, device=device, dtype=dtype)
    return (
        query, order, dense(sinks), dense(sinks), sink_len, *codes, *vcodes, num_groups,
        dense(residual), dense(residual), residual_len, head_dim**-0.5,
    )  # fmt: skip


def check_decode(device):
    worst = 0.0
    for dtype in (torch.float16, torch.bfloat16):
        for head_dim in (64, 128):
            for ratio in (1, 4, 7):
                for preset in PRESETS:
                    args = make_cache(3, 2, ratio, head_dim, preset, 5, 32, 128, dtype, device)
                    got = decode_attention(*args).float()
                    want = decode_attention_reference(*args).float()
                    err = (got - want).abs().max().item()
                    worst = max(worst, err)
                    assert err < 2e-2, (dtype, head_dim, ratio, preset, err)
    empty = make_cache(2, 2, 4, 128, "pnmix-1", 3, 32, 128, torch.bfloat16, device,
                       lengths=(torch.tensor([0, 3]), torch.tensor([0, 2]), torch.tensor([0, 1])))  # fmt: skip
    out = decode_attention(*empty)
    assert torch.all(out[0] == 0) and not out.isnan().any()
    print(f"decode vs float32 reference: max abs error {worst:.2e} (fp16/bf16), empty sequence -> zeros")


def check_torch_integration(device):
    args = make_cache(2, 2, 4, 128, "pnmix-1", 3, 32, 128, torch.bfloat16, device)
    torch.library.opcheck(torch.ops.pnmix.decode_attention.default, args)
    keys = torch.randn(2, 2, 128, 128, device=device, dtype=torch.bfloat16)
    order = random_order(2, 2, 128, 64, device)
    torch.library.opcheck(torch.ops.pnmix.pack_keys.default, (keys, order, 64, 128, 3, 1, True))
    torch.library.opcheck(torch.ops.pnmix.pack_values.default, (keys, 2, 128, True))
    compiled = torch.compile(lambda *a: decode_attention(*a) * 2, fullgraph=True)
    assert torch.equal(compiled(*args), decode_attention(*args) * 2)
    static_out = decode_attention(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = decode_attention(*args)
    args[4].fill_(0)  # sink_len changes on device; the replay must follow
    graph.replay()
    assert torch.equal(static_out, decode_attention(*args))
    print("opcheck (cuda), torch.compile fullgraph, CUDA graph replay: ok")


def bench(device, quick):
    print("decode step, one layer (Hq=32, H=8, D=128, bf16), GPU time (CUDA graph) and eager time per call;")
    print("SDPA over an unquantized bf16 cache of the same length for comparison")
    shapes = [(1, 32768), (8, 8192), (32, 8192)]
    if not quick:
        shapes = [(1, 4096), *shapes, (32, 32768)]
    for batch, tokens in shapes:
        for preset in ("pnmix-1", "pnmix-2", "kivi-2"):
            group = PRESETS[preset][1]
            cap = (tokens - 32 - 128) // group
            lengths = (torch.full((batch,), 32), torch.full((batch,), cap), torch.full((batch,), 128))
            args = make_cache(batch, 8, 4, 128, preset, cap, 32, 128, torch.bfloat16, device, lengths)
            graph_ms = do_bench_cudagraph(lambda: decode_attention(*args))
            eager_ms = do_bench(lambda: decode_attention(*args))
            cache_bytes = sum(t.numel() * t.element_size() for t in args[2:16])
            print(f"  B={batch:2d} T={tokens:5d} {preset:8s}: {graph_ms * 1e3:7.1f} us GPU "
                  f"({cache_bytes / graph_ms / 1e6:5.0f} GB/s of cache), {eager_ms * 1e3:7.1f} us eager")
        keys = torch.randn(batch, 8, tokens, 128, device=device, dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        query = torch.randn(batch, 32, 1, 128, device=device, dtype=torch.bfloat16)
        sdpa_ms = do_bench_cudagraph(lambda: F.scaled_dot_product_attention(query, keys, values, enable_gqa=True))
        print(f"  B={batch:2d} T={tokens:5d} SDPA bf16: {sdpa_ms * 1e3:7.1f} us GPU "
              f"({2 * keys.numel() * 2 / sdpa_ms / 1e6:5.0f} GB/s)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer benchmark shapes")
    quick = parser.parse_args().quick
    device = torch.device("cuda")
    torch.manual_seed(0)
    check_pack(device)
    check_decode(device)
    check_torch_integration(device)
    bench(device, quick)


if __name__ == "__main__":
    main()
