"""Host cost of small CUDA-side operations, microseconds per call.

Usage (GPU machine): python scripts/bench_host_ops.py

The floor under a step's host time: each torch op, event, stream switch or Triton launch the
step path issues costs about this much on the machine it runs on."""
import time

import torch

dev0 = torch.device("cuda")
dev = torch.device("cuda", 0)
a = torch.zeros(64, dtype=torch.int32, device=dev)
b = torch.zeros(64, dtype=torch.int32, device=dev)
pinned = torch.zeros(1 << 16, dtype=torch.uint8).pin_memory()
s2 = torch.cuda.Stream()
ev = torch.cuda.Event()
ev.record()
g = torch.cuda.CUDAGraph()
x = torch.zeros(16, device=dev)
with torch.cuda.graph(g):
    x.add_(1)


def t(name, fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(n):
        fn()
    el = (time.perf_counter() - begin) / n * 1e6
    torch.cuda.synchronize()
    print(f"{name:45s} {el:7.2f} us")


t("current_stream()", lambda: torch.cuda.current_stream())
t("current_stream(cuda:0)", lambda: torch.cuda.current_stream(dev))
t("Event()+record()", lambda: torch.cuda.Event().record())
t("Event()+record(stream)", lambda: torch.cuda.Event().record(torch.cuda.current_stream(dev)))
t("wait_event", lambda: torch.cuda.current_stream(dev).wait_event(ev))
t("event.synchronize (done)", lambda: ev.synchronize())
t("copy_ d2d 64 int", lambda: a.copy_(b))
t("copy_ h2d pinned nonblock", lambda: a.view(torch.uint8).copy_(pinned[:256], non_blocking=True))
t("torch.empty(256, cuda)", lambda: torch.empty(256, dtype=torch.uint8, device=dev))
t("torch.empty(256, 'cuda')", lambda: torch.empty(256, dtype=torch.uint8, device=dev0))
t("slice+view", lambda: a[4:20].view(torch.int32).view(16))
t("torch.sub(out=)", lambda: torch.sub(a[:8], 1, out=b[:8]))
t("graph.replay (tiny)", lambda: g.replay())


def ctx():
    with torch.cuda.stream(s2):
        pass


t("with torch.cuda.stream(s)", ctx)
t("wait_stream", lambda: s2.wait_stream(torch.cuda.current_stream(dev)))
t("record_stream", lambda: a.record_stream(s2))
t("inference_mode ctx", lambda: torch.inference_mode().__enter__())
from mrv2_kernels.input_prep import post_update  # noqa: E402

rows = torch.zeros(1, dtype=torch.int32, device=dev)
qsl = torch.tensor([0, 1], dtype=torch.int32, device=dev)
tok = torch.zeros(1, 1, dtype=torch.int64, device=dev)
one = torch.ones(1, dtype=torch.int32, device=dev)
zero = torch.zeros(1, dtype=torch.int32, device=dev)
tids = torch.zeros(4, 64, dtype=torch.int32, device=dev)
nc = torch.zeros(4, dtype=torch.int32, device=dev)
nt = torch.zeros(4, dtype=torch.int32, device=dev)
t("triton launch (post_update)", lambda: post_update(rows, qsl, 1, tok, one, zero, tids, nc, nt))

import numpy as np  # noqa: E402

from mrv2.contract.staging import Uploader  # noqa: E402

uploader = Uploader(dev)
small = {"a": np.arange(8, dtype=np.int32), "b": np.arange(9, dtype=np.int32),
         "c": np.ones(8, dtype=np.int32)}
t("Uploader.upload (3 arrays of 8-9 ints)", lambda: uploader.upload(small))
t("Uploader.upload (1 array)", lambda: uploader.upload({"a": small["a"]}))
host = uploader._buffers[0]
t("pinned tensor .numpy()", lambda: host.numpy())
packed = torch.empty(64, dtype=torch.uint8, device=dev)
t("packed[a:b].view(int32).view(shape)", lambda: packed[16:48].view(torch.int32).view((8,)))
