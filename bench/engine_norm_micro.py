"""Micro-benchmark of the DP step (PrivateGradient backward + release) on a BERT-like block stack.

    python bench/engine_norm_micro.py [T]      # T = sequence length, default 64

Embedding + 2 blocks (Q, K, V, O 384×384, FFN 384↔1536, LayerNorm) + head, B = 32, one CPU thread,
median CPU time of 9 steps, next to a non-private step of the same model.  Used to measure the cost of
the certified float64 per-example norms (docs/engine.md): run it with PYTHONPATH pointing at two
checkouts, interleaved, on a quiet machine."""
import statistics, sys, time, torch
from torch import nn
torch.set_num_threads(1)
from privtune.engine import PrivateGradient
torch.manual_seed(0)
B, T, D = 32, int(sys.argv[1]) if len(sys.argv) > 1 else 64, 384
class Block(nn.Module):
    def __init__(s):
        super().__init__(); s.q=nn.Linear(D,D); s.k=nn.Linear(D,D); s.v=nn.Linear(D,D); s.o=nn.Linear(D,D)
        s.ln=nn.LayerNorm(D); s.f1=nn.Linear(D,4*D); s.f2=nn.Linear(4*D,D)
    def forward(s,x):
        att=torch.softmax(s.q(x)@s.k(x).transpose(1,2)/D**.5,-1)@s.v(x)
        x=s.ln(x+s.o(att)); return x+s.f2(torch.relu(s.f1(x)))
model=nn.Sequential(nn.Embedding(1000,D), Block(), Block(), nn.Linear(D,2))
class M(nn.Module):
    def __init__(s): super().__init__(); s.m=model
    def forward(s,ids): return s.m(ids).mean(1)
m=M()
ids=torch.randint(0,1000,(B,T)); y=torch.randint(0,2,(B,))
pg=PrivateGradient(m,max_grad_norm=1.0,noise_multiplier=1.0,expected_batch_size=B, seed=0)
def step():
    loss=nn.functional.cross_entropy(m(ids),y,reduction="none"); pg.backward(loss); pg.release()
def nondp():
    with pg.paused():
        m.zero_grad(); nn.functional.cross_entropy(m(ids),y).backward()
for f in (step, nondp): f()
res={}
for name,f in (("dp",step),("nondp",nondp)):
    ts=[]
    for _ in range(9):
        t=time.process_time(); f(); ts.append(time.process_time()-t)
    res[name]=statistics.median(ts)
print(f"T={T} dp step {res['dp']*1e3:.1f} ms, non-DP {res['nondp']*1e3:.1f} ms, ratio {res['dp']/res['nondp']:.2f}")
