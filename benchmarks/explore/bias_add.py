"""The bias of a SparseLinear layer, added to the product that the format writes as C (out,
batch) and the layer returns transposed: which form of the add is cheap (the MLP profile shows
3 x 43 us per step at 4096 x 4096 fp16, 1.5 TB/s).

    python -m benchmarks.explore.bias_add [--width 4096] [--batch 4096]

Forms, do_bench medians (us) and the HBM rate of their bytes (read C once, write once):
  transposed  y = C.t() + bias             (what the layer does now)
  in place    C.add_(bias[:, None]); C.t() (no new tensor, the same layout)
  prefill     bias[:, None].expand(out, batch).contiguous()  (the write alone: a product
              accumulating into a bias-filled C would pay this instead of the add)
  contiguous  y2 + bias with y2 (batch, out) contiguous (a product writing y directly)

Measured (H200, `session8/call7/bias_add.log`, 4096 x 4096 fp16): transposed 45.8 us, in place
50.1, prefill 32.9, contiguous 45.9 (1.0-1.5 TB/s): the layout is not what makes the add
slow, so neither returning the product in another layout nor a bias-filled C would gain
much; the add costs a pass over C whatever its form, and only adding the bias in the
product's epilogue (a statement term the language does not have yet) removes it.
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4096)
    args = parser.parse_args()
    from triton.testing import do_bench

    out, batch = args.width, args.batch
    C = torch.randn(out, batch, device="cuda", dtype=torch.float16)
    y2 = torch.randn(batch, out, device="cuda", dtype=torch.float16)
    bias = torch.randn(out, device="cuda", dtype=torch.float16)
    size = C.numel() * C.element_size()
    forms = {
        "transposed": (lambda: C.t() + bias, 2 * size),
        "in place": (lambda: C.add_(bias[:, None]).t(), 2 * size),
        "prefill": (lambda: bias[:, None].expand(out, batch).contiguous(), size),
        "contiguous": (lambda: y2 + bias, 2 * size),
    }
    torch.testing.assert_close(forms["transposed"][0](), (C.float().t() + bias.float()).half())
    for name, (fn, nbytes) in forms.items():
        ms = do_bench(fn, warmup=25, rep=200)
        print(f"{name:11s} {ms * 1e3:7.1f} us  {nbytes / ms / 1e9:5.2f} TB/s")


if __name__ == "__main__":
    main()
