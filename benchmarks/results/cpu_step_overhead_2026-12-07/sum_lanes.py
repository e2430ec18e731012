"""Which vector width torch's CPU float sum reads a contiguous row in: a numpy emulation of
ATen's SumKernel.cpp (vectorized_inner_sum -> row_sum -> multi_row_sum: 4 interleaved vector
accumulators, 4 cascade levels, lanes added in order) at 8 and 16 lanes against
``x.pow(2).sum(-1)`` on random rows of 24..32768 values. Prints per width the rows that differ
(torch 2.13 on the AVX-512 VM: 8 lanes 0 of 200, 16 lanes ~half): what row_norms.c follows."""
import numpy as np, torch
torch.set_num_threads(1)
f=np.float32
def emu(x, lanes, ilp=4, levels=4, final_order="seq"):
    n=len(x); vecs=n//lanes; size=vecs//ilp
    def cl2(v): return 1 if v<=2 else int(v-1).bit_length()
    power=max(4, cl2(size)//levels); step=1<<power; mask=step-1
    acc=np.zeros((levels,ilp,lanes),dtype=np.float32)
    i=0
    while i+step<=size:
        for j in range(step):
            for k in range(ilp):
                acc[0][k]=(acc[0][k]+x[(i*ilp+k)*lanes:(i*ilp+k+1)*lanes]).astype(f)
            i+=1
        for j in range(1,levels):
            acc[j]=(acc[j]+acc[j-1]).astype(f); acc[j-1]=0
            if i & (mask<<(j*power)): break
    while i<size:
        for k in range(ilp):
            acc[0][k]=(acc[0][k]+x[(i*ilp+k)*lanes:(i*ilp+k+1)*lanes]).astype(f)
        i+=1
    for j in range(1,levels): acc[0]=(acc[0]+acc[j]).astype(f)
    for v in range(size*ilp, vecs): acc[0][0]=(acc[0][0]+x[v*lanes:(v+1)*lanes]).astype(f)
    for k in range(1,ilp): acc[0][0]=(acc[0][0]+acc[0][k]).astype(f)
    total=f(0)
    for t in range(vecs*lanes,n): total=f(total+x[t])
    if final_order=="seq":
        for l in range(lanes): total=f(total+acc[0][0][l])
    else:  # tree horizontal
        a=acc[0][0].copy()
        while len(a)>1:
            h=len(a)//2; a=(a[:h]+a[h:]).astype(f)
        total=f(total+a[0])
    return total
g=np.random.default_rng(0)
for n in (128,1024):
  x=(g.standard_normal(n)*3).astype(f)
  sq=(x*x).astype(f)
  t=torch.from_numpy(x).pow(2).sum(-1).item()
  for lanes in (8,16):
    for fo in ("seq","tree"):
      print(n, lanes, fo, emu(sq,lanes,final_order=fo)==f(t))
  print("numpy pairwise", np.sum(sq)==f(t), "seq", f(sum(sq.astype(np.float64)))==f(t))
bad={8:0,16:0}
for trial in range(200):
  n=[128,1024,2816,4096,5120,100,24,16384*2][trial%8]
  x=(g.standard_normal(n)*10**g.uniform(-3,3)).astype(f)
  sq=(x*x).astype(f)
  t=torch.from_numpy(x).pow(2).sum(-1).item()
  for lanes in (8,16):
    bad[lanes]+= emu(sq,lanes)!=f(t)
print(bad)
