"""The Triton transfer kernels, run on CPU tensors by Triton's interpreter (``TRITON_INTERPRET=1``), must move the
same bytes as the torch implementation for every host layout and device layout (incl. kernel-block regrouping,
block-outermost layouts, layer subsets, MLA). The interpreter is selected when triton is imported, so the check
runs in a fresh subprocess with the variable set."""
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(r'''
    import os, random, zlib
    assert os.environ["TRITON_INTERPRET"] == "1"
    import torch
    from tierkv.connector.l2.device_pool import DevicePool
    from tierkv.connector.l2.host_pool import HOST_POOL_LAYOUTS, HostPool
    from tierkv.kernels import load_pages, save_pages
    from tierkv.kernels.testing import DEVICE_LAYOUTS, make_kv_caches

    cases = 0
    for name in DEVICE_LAYOUTS:
        for ratio in (1, 2):
            if ratio == 2 and "bl" in name:
                continue
            kv, storage, spec = make_kv_caches(name, num_layers=2, num_blocks=6, block_size=32,
                                               kernel_block_size=32 // ratio, num_kv_heads=2, head_dim=8,
                                               seed=ratio)
            dev = DevicePool.from_vllm(kv, num_blocks=6, block_size=32, kv_cache_layout=spec.kv_cache_layout,
                                       backend=spec.backend, use_mla=spec.use_mla)
            rng = random.Random(zlib.crc32(f"{name}/{ratio}".encode()))  # stable seed (str hash() changes per run)
            for layout in HOST_POOL_LAYOUTS:
                for layers in (None, [1]):
                    blocks, slots = rng.sample(range(6), 3), rng.sample(range(4), 3)
                    a = HostPool.for_device(dev, 4, layout); a.buffer.fill_(1)
                    b = HostPool.for_device(dev, 4, layout); b.buffer.fill_(1)
                    save_pages(dev, a, blocks, slots, layers, impl="triton")
                    save_pages(dev, b, blocks, slots, layers, impl="torch")
                    assert torch.equal(a.buffer, b.buffer), (name, ratio, layout, layers, "save")
                    assert a.buffer.ne(1).any()
                    orig = storage.clone()
                    storage[256:].zero_()
                    load_pages(a, dev, slots, blocks, layers, impl="triton")
                    got = storage.clone()
                    storage[256:].zero_()
                    load_pages(b, dev, slots, blocks, layers, impl="torch")
                    assert torch.equal(got, storage), (name, ratio, layout, layers, "load")
                    storage.copy_(got)
                    loaded = {(l, x): dev.block_bytes_view(l)[x].clone() for l in range(2) for x in blocks}
                    storage.copy_(orig)
                    for (l, x), v in loaded.items():  # the round trip restored the saved blocks bit-exactly
                        if layers is None or l in layers:
                            assert torch.equal(v, dev.block_bytes_view(l)[x]), (name, layout, l, x)
                        else:
                            assert not v.any()
                    cases += 1
    print("TRITON_OK", cases)
''')


def test_triton_kernels_match_torch_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "TRITON_OK 72" in r.stdout, r.stdout[-2000:]
