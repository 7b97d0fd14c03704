import numpy as np, bisect
L=[l.split() for l in open('/tmp/priod-stamps/move.log')]
C=[tuple(map(float,l.split())) for l in open('/tmp/priod-stamps/client.log')]
R=sorted(float(l[1]) for l in L if l[0]=='R'); R2={float(l[1]):float(l[2]) for l in L if l[0]=='R'}
S=sorted(tuple(map(float,l[1:])) for l in L if l[0]=='S')
M=sorted(tuple(map(float,l[1:])) for l in L if l[0]=='M')
W=sorted(tuple(map(float,l[1:])) for l in L if l[0]=='W')
rows=[]
for t,tb,tc,cr in C[-100:]:
    r=R[bisect.bisect(R,t)]; 
    s=S[bisect.bisect(S,(t,))]
    m=M[bisect.bisect(M,(s[1],))]
    w=W[bisect.bisect(W,(m[2],))]
    rows.append((tb-t, r-tb, R2[r]-r, s[0]-R2[r], s[1]-s[0], m[0]-s[1], m[1]-m[0], m[2]-m[1], w[0]-m[2], w[1]-w[0], s[2]-w[1], s[3]-s[2], cr-s[3], tc-cr, tc-t))
a=np.array(rows)*1e6
names=("client encode+send","send->daemon readable","recvmsg","recv->arrival","arrival->first submit","submit->put","put->worker","move","move end->wake call","call->loop runs","loop->poll end","end->copy_finished","copy_finished->client readable","client readable->done","TOTAL wall")
for n,c in zip(names,a.T): print(f"{n:26s} p50 {np.median(c):6.0f} p90 {np.percentile(c,90):6.0f}")
