"""What a checkpoint costs (issue 37): the time to write one and its size, for the job's model and for resnet50 (with
Adam's state and a window's gradients, as `Checkpoint` saves them), and the training time with checkpoints against
without, side by side in alternating rounds: at the default cadence (every 5 minutes: none in a short run, so the cost
is the bookkeeping) and every optimizer step. Then (issue 54) resnet50 under FSDP2 on 2 gloo processes, with Adam's
state sharded: today's per-rank file (each rank its shards) against the DCP folder an elastic run writes
(`sharded_checkpoint`), written and read back in alternating rounds, and the DCP folder read on one process (whole
tensors: what a resume on another number of processes does; a per-rank file cannot be).

    python bench/checkpoint_cost.py [--rounds 7] [--skip-dcp]"""
import argparse, statistics, sys, tempfile, time, warnings
from pathlib import Path

import torch, torch.nn as nn
warnings.filterwarnings('ignore')
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import conv_net, images, learner, machine

from accum_callback import Checkpoint, GradientAccumulation
from accum_callback.resume.checkpoint import _write, read_checkpoint

def one_write(model, d:Path, repeats:int=5):
    "Median seconds to write and to read a checkpoint of `model` (weights, gradients, Adam's two moments), and its bytes"
    from fastai.optimizer import Adam
    for p in model.parameters(): p.grad = torch.randn_like(p)
    opt = Adam(list(model.parameters()), lr=1e-3)
    for p in model.parameters(): opt.state[p] = dict(grad_avg=torch.randn_like(p), sqr_avg=torch.rand_like(p), step=1)
    state = dict(model=model.state_dict(), grads=[p.grad for p in model.parameters()], opt=opt.state_dict())
    w,r = [],[]
    for i in range(repeats):
        f = d/f'c{i}.pt'
        t0 = time.perf_counter(); n = _write(f, state); w.append(time.perf_counter()-t0)
        t0 = time.perf_counter(); read_checkpoint(f); r.append(time.perf_counter()-t0)
        f.unlink()
    return statistics.median(w),statistics.median(r),n

_PEAK = """
import os, sys, threading, time, torch
from accum_callback.resume.format import read_checkpoint
rss = lambda: int(open('/proc/self/statm').read().split()[1])*os.sysconf('SC_PAGE_SIZE')
base,peak,done = rss(),[0],False
def watch():   # (the resident size every millisecond while the file is read: its peak above the start)
    while not done: peak[0] = max(peak[0], rss()); time.sleep(0.001)
t = threading.Thread(target=watch); t.start()
st = read_checkpoint(sys.argv[1])
peak[0] = max(peak[0], rss()); done = True; t.join()
print(peak[0] - base)
"""

def read_peak(model, d:Path)->tuple:
    """How much a fresh process's peak resident memory rises reading a checkpoint of `model`: over the file's size, and
    in MiB (a small file's ratio is mostly the code pages torch touches reading it, a few MiB whatever the size)"""
    import subprocess
    f = d/'peak.pt'
    _write(f, dict(model=model.state_dict()))
    r = subprocess.run([sys.executable, '-c', _PEAK, str(f)], capture_output=True, text=True, check=True)
    return int(r.stdout.split()[-1])/f.stat().st_size,int(r.stdout.split()[-1])/2**20

class _TimedEnd(Checkpoint):
    "A `Checkpoint` that times its `after_fit` (the fit's end checkpoint, written before `fit` returns)"
    def after_fit(self):
        t0 = time.perf_counter()
        try: super().after_fit()
        finally: self.end_s = time.perf_counter() - t0

def train_ratio(rounds:int, d:Path):
    """Median of per-round ratios (with checkpoints / without) of a small conv net's fit, and their spread; for the
    default cadence also the fit's end checkpoint's seconds and the ratio without them (what the cadence costs a batch)"""
    ds = images(512, 32)
    def fit(extra):
        learn = learner(conv_net(), ds, 16, cbs=[GradientAccumulation(n_step=4)] + extra)
        t0 = time.perf_counter()
        with learn.no_bar(), learn.no_logging(): learn.fit(2)
        return time.perf_counter()-t0,getattr(extra[0], 'end_s', 0.) if extra else 0.
    kinds = dict(plain=lambda: [], minutes5=lambda: [_TimedEnd(d/'m5', every='5min', resume=False)],
                 every_step=lambda: [Checkpoint(d/'e1', every='step', resume=False)])
    fit([])   # warm-up
    times,ends = {k: [] for k in kinds},[]
    for r in range(rounds):
        order = list(kinds)[r % 3:] + list(kinds)[:r % 3]
        for k in order:
            t,end = fit(kinds[k]()); times[k].append(t)
            if k == 'minutes5': ends.append(end)
    def spread(ratios):
        med = statistics.median(ratios)
        return med,1.4826*statistics.median([abs(x-med) for x in ratios])
    out = {k: (*spread([a/b for a,b in zip(times[k], times['plain'])]), statistics.median(times[k])) for k in ('minutes5', 'every_step')}
    out['minutes5_less_end'] = (*spread([(a-e)/b for a,e,b in zip(times['minutes5'], ends, times['plain'])]), statistics.median(ends))
    return out, statistics.median(times['plain'])

def _sharded_resnet(world):
    "resnet50 under FSDP2 (each bottleneck block and the root sharded), fastai's Adam with its moments filled"
    from torch.distributed.device_mesh import init_device_mesh
    from torchvision.models import resnet50
    from fastai.optimizer import Adam
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    m = resnet50(weights=None)
    if world > 1:
        mesh = init_device_mesh('cpu', (world,))
        for layer in (m.layer1, m.layer2, m.layer3, m.layer4):
            for block in layer: fully_shard(block, mesh=mesh)
        fully_shard(m, mesh=mesh)
    opt = Adam(list(m.parameters()), lr=1e-3)
    for p in m.parameters(): opt.state[p] = dict(grad_avg=torch.randn_like(p), sqr_avg=torch.rand_like(p), step=1)
    return m,opt

def _dcp_rank(rank, world, d, rounds):
    "On each rank: per-rank file against DCP folder, written and read, alternating; rank 0 returns the times and sizes"
    import torch.distributed as dist
    from accum_callback.compat.torch import local_tensor
    from accum_callback.resume.sharded import load_sharded, save_sharded, strip_sharded
    d = Path(d)
    m,opt = _sharded_resnet(world)
    def state(whole=True):   # (as `Checkpoint` takes it: without the model where the DCP folder holds it)
        return dict(model={k: local_tensor(v).clone() for k,v in m.state_dict().items()} if whole else {}, grads=[None]*len(list(m.parameters())), opt=opt.state_dict())
    def per_rank(r):
        f = d/f'pr{r}.rank{rank}.pt'
        dist.barrier(); t0 = time.perf_counter(); _write(f, state()); dist.barrier(); w = time.perf_counter()-t0
        t0 = time.perf_counter(); st = read_checkpoint(f)
        with torch.no_grad():
            sd = m.state_dict()
            for k,v in st['model'].items(): local_tensor(sd[k]).copy_(v)
        dist.barrier(); return w,time.perf_counter()-t0,sum(x.stat().st_size for x in d.glob(f'pr{r}.rank*.pt'))
    def sharded(r):
        f = d/f'dc{r}.rank{rank}.pt'
        dist.barrier(); t0 = time.perf_counter()
        _write(f, strip_sharded(state(whole=False), save_sharded(d/f'dc{r}.dcp', m, opt))); dist.barrier(); w = time.perf_counter()-t0
        t0 = time.perf_counter(); load_sharded(d, read_checkpoint(f), m, opt); dist.barrier()
        size = sum(x.stat().st_size for x in (d/f'dc{r}.dcp').iterdir()) + sum(x.stat().st_size for x in d.glob(f'dc{r}.rank*.pt'))
        return w,time.perf_counter()-t0,size
    per_rank(-1); sharded(-1)   # warm-up
    out = {'per-rank file': [], 'DCP folder': []}
    for r in range(rounds):
        pair = [('per-rank file', per_rank), ('DCP folder', sharded)]
        for k,f in (pair if r % 2 == 0 else pair[::-1]): out[k].append(f(r))
    return out

def dcp_cost(rounds:int, d:Path):
    from accum_callback.testing import launch_gloo
    from accum_callback.resume.sharded import load_sharded
    res = launch_gloo(_dcp_rank, world=2, args=(str(d), rounds), timeout=600, start='fork')[0]
    print("resnet50 under FSDP2 on 2 gloo processes, Adam's moments sharded (one thread each):")
    med = lambda xs: statistics.median(xs)
    for k,rows in res.items():
        print(f"  {k}: written in {med([r[0] for r in rows]):.3f} s, read in {med([r[1] for r in rows]):.3f} s, "
              f"{rows[0][2]/2**20:.1f} MiB on disk (medians of {rounds})")
    for j,what in ((0, 'write'), (1, 'read')):
        ratios = [b[j]/a[j] for a,b in zip(res['per-rank file'], res['DCP folder'])]
        print(f"  DCP / per-rank file, {what}: {med(ratios):.3f} (per round: {min(ratios):.3f} to {max(ratios):.3f})")
    m,opt = _sharded_resnet(1)   # one process, whole tensors, no process group: the elastic resume's read
    from accum_callback.resume.format import read_checkpoint as read
    ts = []
    for r in range(min(3, rounds)):
        t0 = time.perf_counter(); load_sharded(d, read(d/f'dc{r}.rank0.pt'), m, opt); ts.append(time.perf_counter()-t0)
    print(f"  the DCP folder read on 1 process (another number of processes, whole tensors): {med(ts):.3f} s (median of {len(ts)}); "
          "a per-rank file cannot be")

def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--rounds', type=int, default=7)
    p.add_argument('--skip-dcp', action='store_true', help='leave out the FSDP2 part (per-rank file against DCP)')
    a = p.parse_args()
    torch.set_num_threads(1)
    print(machine())
    from accum_finetune.models import DEFAULT_ARCH, create_model
    from torchvision.models import resnet50
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        for name,m in ((f'the job\'s model ({DEFAULT_ARCH})', create_model(DEFAULT_ARCH, 10)), ('resnet50', resnet50(weights=None))):
            w,r,n = one_write(m, d)
            print(f"{name}: {sum(p.numel() for p in m.parameters())/1e6:.2f}M parameters, checkpoint {n/2**20:.1f} MiB, "
                  f"written in {w:.3f} s, read and checked in {r:.3f} s (medians of 5)")
            ratio,mib = read_peak(m, d)
            print(f"  reading it raises a fresh process's peak memory by {ratio:.2f}x the file's size, {mib:.1f} MiB (3.01x before 0.3, resnet50)")
        res,plain = train_ratio(a.rounds, d)
        print(f"training, conv net 32px, micro-batch 16 x 4, 2 epochs of 512 images: {plain:.2f} s without checkpoints (median)")
        for k,label in (('minutes5', 'every 5 minutes (the default cadence; none fall due in the run)'), ('every_step', 'every optimizer step')):
            med,spread,t = res[k]
            print(f"with checkpoints {label}: {med:.3f} ± {spread:.3f} of the time without ({a.rounds} alternating rounds)")
            if k == 'minutes5':
                med,spread,end = res['minutes5_less_end']
                print(f"  of which the fit's end checkpoint (once a fit, whatever its length): {1e3*end:.1f} ms (median); "
                      f"without it (the cadence's check at every batch, the fit's start): {med:.3f} ± {spread:.3f}")
        if not a.skip_dcp: dcp_cost(a.rounds, d)

if __name__ == '__main__': main()
