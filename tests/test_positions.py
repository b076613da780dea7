"""The RoPE tables the cache uses follow the positions' values, not the identity of a position tensor."""

from __future__ import annotations

import torch

from h2o_cli.cache import H2OCache
from h2o_cli.config import CacheSettings


def test_position_tensor_rewritten_in_place_is_not_served_stale_rotations(tiny_pair):
    """Regression: the RoPE memo was keyed on tensor identity; a caller reusing its position tensor in place
    got the previous chunk's cos/sin for the first layer. Compare with fresh tensors for every call."""
    reference, model = tiny_pair
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    settings = CacheSettings(budget=64, policy="full", positions="original", chunk=4)
    fresh, reused = H2OCache(model, settings), H2OCache(model, settings)
    positions = torch.arange(4).view(1, 4)
    with torch.no_grad():
        for start in range(0, 12, 4):
            piece = ids[:, start : start + 4]
            expected = model(input_ids=piece, cache=fresh, position_ids=torch.arange(start, start + 4)[None])
            if start:
                positions.add_(4)  # the same tensor object, rewritten in place
            got = model(input_ids=piece, cache=reused, position_ids=positions)
            plain = reference(input_ids=ids[:, : start + 4]).logits[:, start:]
            torch.testing.assert_close(got.logits, expected.logits, rtol=0, atol=0)
            torch.testing.assert_close(got.logits, plain, rtol=1e-4, atol=1e-4)


def test_kernel_rotate_is_bitwise_the_rotate_half_formula():
    """`h2o_kernels.reference.rotate` builds rotate_half in place; it must give exactly
    `x * cos + rotate_half(x) * sin` (the model's formula), for every dtype and broadcast it is used with."""
    from h2o_kernels.reference import rotate

    from h2o_cli.cache.positions import rotate_half

    generator = torch.Generator().manual_seed(0)
    shapes = [((3, 666, 64), (3, 666, 64)), ((9, 5, 64), (5, 64)), ((9, 64), (64,)), ((1, 3, 8), (4, 3, 8))]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for x_shape, table_shape in shapes:
            x = torch.randn(x_shape, generator=generator).to(dtype)
            for table_dtype in (dtype, torch.float32):
                cos, sin = (torch.randn(table_shape, generator=generator).to(table_dtype) for _ in range(2))
                want = x * cos + rotate_half(x) * sin
                got = rotate(x, cos, sin)
                assert got.dtype == want.dtype and torch.equal(got, want), (dtype, x_shape, table_dtype)
