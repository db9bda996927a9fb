"""sparse/kernels/tuning.py: compile_all compiles every candidate (real compiles for sm_90 on the
CPU, with a stand-in driver), and tuned_config remembers what it chose."""
import pytest
import torch

from sparse.kernels import common, spmv, tuning
from tests.sparse_kernel_testing import random_packed


@pytest.mark.skipif(common.INTERPRETING or torch.cuda.is_available(),
                    reason="compiles for sm_90 with a stand-in driver; the GPU tests compile for the real one")
def test_compile_all_fills_the_jit_cache_with_every_config(monkeypatch):
    # Real compiles (Triton to PTX to a cubin) without a GPU: the JIT's driver stands in for an
    # sm_90 device, and the kernel gets an empty cache of its own for the test.
    from collections import defaultdict

    import triton
    from triton.runtime.driver import driver

    from tests.sass import Sm90StandIn
    monkeypatch.setattr(driver, "_active", Sm90StandIn())
    monkeypatch.setattr(spmv.spmv_kernel, "device_caches", defaultdict(spmv.spmv_kernel.create_binder))
    monkeypatch.setattr(tuning, "COMPILE_THREADS", 2)
    values, mask = random_packed(64, 128, "2:4", 9, dtype=torch.bfloat16)
    x = torch.ones(1, 128, dtype=torch.bfloat16)
    configs = [(1, 4, 1), (2, 2, 1), (2, 2, 2), (4, 1, 1)]
    tuning.compile_all(configs, lambda c: spmv.spmv(x, values, mask, config=c, compile_only=True))
    compiled = spmv.spmv_kernel.device_caches[0][0].values()
    assert sorted(kernel.metadata.num_warps for kernel in compiled) == [1, 2, 2, 4]
    assert all(isinstance(kernel, triton.compiler.CompiledKernel) and kernel.asm["cubin"] for kernel in compiled)


def test_tuned_config_remembers_its_choice_and_takes_the_first_off_cuda():
    cache, x = {}, torch.zeros(1, 4)
    never = lambda *args: pytest.fail("nothing is timed off CUDA")  # noqa: E731
    assert tuning.tuned_config(cache, "key", [(1, 2), (3, 4)], x, x, x, never, never) == (1, 2)
    assert cache == {"key": (1, 2)}
    cache["key"] = (3, 4)  # as a tuning on the GPU would have left it
    assert tuning.tuned_config(cache, "key", [(1, 2), (3, 4)], x, x, x, never, never) == (3, 4)


@pytest.mark.parametrize("out_features, in_features, copies", [
    (1024, 4096, 39),  # Llama-3.1-8B's k_proj at 2:4: 4.7 MB, copies past three L2s
    (64, 64, tuning.TUNING_MAX_COPIES),  # a stories260K layer would need ~40,000
])
def test_a_tuner_times_each_config_over_copies_of_the_weight_past_the_l2_but_at_most_a_cap(
        monkeypatch, out_features, in_features, copies):
    timed = []

    def count_calls(calls, target_ms, replays):  # time_in_cuda_graph needs CUDA; count what it would time
        timed.append(len(calls))
        return 2.0 - len(timed)  # the later config is the faster

    monkeypatch.setattr(tuning, "time_in_cuda_graph", count_calls)
    values = torch.empty(out_features, in_features // 2, dtype=torch.bfloat16, device="meta")
    mask = torch.empty(in_features // 32, out_features, dtype=torch.int32, device="meta")
    assert tuning.fastest_in_cuda_graph(["a", "b"], values, mask, run=None) == "b"
    assert timed == [copies, copies]
