"""The GEMM co-tenant both probes run: bf16 8192^3 GEMMs back to back in a process of its own."""
GEMM = """
import torch, sys
n = 8192
a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda"); b = torch.randn_like(a); c = torch.empty_like(a)
torch.matmul(a, b, out=c); torch.cuda.synchronize()
print("gemm co-tenant running", flush=True)
prev = None
while True:
    for _ in range(4):
        torch.matmul(a, b, out=c)
    ev = torch.cuda.Event(); ev.record()
    if prev is not None:
        prev.synchronize()
    prev = ev
"""

