"""The smoke test's NCCL version decoding, for any version (hypothesis): it inverts NCCL's
version macro in both encodings. The rest of the `nccl` checks are tests/unit/test_nccl.py."""

from __future__ import annotations

from hypothesis import given, strategies as st

from envbuild.image import nccl


def nccl_version_macro(x: int, y: int, z: int) -> int:
    """NCCL_VERSION(X,Y,Z) of nccl.h.in (https://github.com/NVIDIA/nccl/blob/v2.30.7-1/src/nccl.h.in)."""
    return x * 1000 + y * 100 + z if x <= 2 and y <= 8 else x * 10000 + y * 100 + z


@given(st.integers(1, 9), st.integers(0, 99), st.integers(0, 99))
def test_decode_inverts_nccl_s_version_macro_in_both_encodings(x, y, z):
    assert nccl.decode_version(nccl_version_macro(x, y, z)) == f"{x}.{y}.{z}"
