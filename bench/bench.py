"""What accumulation costs in time and saves in memory, measured side by side in one run.

    python bench/bench.py                  # CPU; the CUDA rows run too when a GPU is present
    python bench/bench.py --quick          # tiny sizes, one repeat: a smoke test, not a measurement
    python bench/bench.py --repeats 7 --out bench.md

Prints a markdown table `measure | ratio | goal | met?`, the machine and the command. Timings alternate the contenders
round by round (the order rotates every round, after one warm-up round) and quote the median of the per-round ratios,
± 1.4826 x their median absolute deviation. Memory: each configuration trains in a fresh process forked before this one
has run any tensor op, which reports the peak RSS it adds over its own baseline taken after model and data exist
(Linux `/proc/self/clear_refs` peak reset + `VmHWM`); on CUDA, `torch.cuda.max_memory_allocated` over the baseline."""
import argparse, datetime, shlex, sys, time, warnings
from functools import partial

warnings.filterwarnings('ignore')
import torch
import torch._dynamo   # noqa: F401  torch.optim imports it on first use (seconds): once here, before the forks
from fastai.callback.training import GradientAccumulation as FastaiGA

from accum_callback import GradientAccumulation, BatchNormAccumulation
from accum_callback.batchnorm.window_stats import WINDOW_MODES
from common import (BN_MODES, bn_cut, LR, MOM, CudaSync, conv_net, fit_time, forked, hand_loop, images, launch_gloo, learner, machine,
                    na_row, rounds, summary, table, time_row, verdict)
SIZES = dict(  # b: micro-batch, k: micro-batches per window, windows per epoch, px: image side, width: first conv channels
    default=dict(b=16, k=8, windows=4, px=32, width=32, mem_windows=2, ddp=dict(b=16, k=8, steps=4, hidden=2048)),
    quick  =dict(b=4,  k=4, windows=2, px=16, width=8,  mem_windows=1, ddp=dict(b=4,  k=4, steps=1, hidden=64)))

# -- 1. time per epoch: ours / fastai's / a hand-written loop -------------------------------------------------------
def speed_section(sz, repeats, warmup):
    b,k = sz['b'],sz['k']
    ds = images(b*k*sz['windows'], sz['px'])
    net = partial(conv_net, sz['width'])
    contenders = {'ours':   partial(fit_time, learner(net(), ds, b, [GradientAccumulation(n_step=k)])),
                  'fastai': partial(fit_time, learner(net(), ds, b, [FastaiGA(n_acc=b*k)])),
                  'hand':   hand_loop(net(), ds, b, k)}
    t,errs = rounds(contenders, repeats, warmup)
    if errs: raise RuntimeError(errs)
    rows = [time_row(f'time/epoch: ours / fastai `GradientAccumulation(n_acc={b*k})`', t['ours'], t['fastai'], 1.00),
            time_row('time/epoch: ours / hand-written PyTorch loop', t['ours'], t['hand'], 1.05)]
    return rows, {f'{n} s/epoch': summary(v) for n,v in t.items()}

# -- 2. memory training adds (fresh forked process per configuration) -----------------------------------------------
def _status_kb(field):
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith(field): return int(line.split()[1])

def _reset_peak()->bool:
    try:
        with open('/proc/self/clear_refs', 'w') as f: f.write('5')   # Linux >= 4.0: VmHWM := VmRSS
        return True
    except OSError: return False

def _fixed_malloc():
    "glibc: mmap every block over 128 KiB and give freed memory back, so RSS follows what is allocated"
    try:
        import ctypes
        libc = ctypes.CDLL('libc.so.6')
        libc.mallopt(-3, 128*1024); libc.mallopt(-1, 128*1024)   # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD (fixed: no dynamic growth)
    except (OSError, AttributeError): pass

def _mem_worker(sz, config, conn):
    try:
        import gc, resource
        _fixed_malloc()
        b,k = sz['b'],sz['k']
        bs,n_acc = {'big': (b*k, 1), 'accum': (b, k), 'micro': (b, 1)}[config]
        def make(windows):
            return learner(conv_net(sz['width']), images(b*k*windows, sz['px']), bs, [GradientAccumulation(n_step=n_acc)]*(n_acc > 1))
        # A throw-away fit of the same shapes first: the library code pages it touches count in RSS too
        warm = make(1); fit_time(warm); del warm
        learn = make(sz['mem_windows'])
        gc.collect()
        if _reset_peak(): base,peak,method = _status_kb('VmRSS'),lambda: _status_kb('VmHWM'),'peak RSS (VmHWM after clear_refs)'
        else:
            base,method = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,'ru_maxrss (peak reset unavailable)'
            peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        fit_time(learn)
        conn.send(dict(kb=peak()-base, method=method))
    except BaseException as e: conn.send(dict(error=f'{type(e).__name__}: {e}'))
    finally: conn.close()

def memory_section(sz):
    b,k = sz['b'],sz['k']
    m = {c: forked(_mem_worker, sz, c) for c in ('big', 'accum', 'micro')}
    names = (f'memory: micro-batch {b} x {k} / batch {b*k}', f'memory: micro-batch {b} x {k} / batch {b} alone')
    bad = next((v['error'] for v in m.values() if 'error' in v), None)
    if bad: return [na_row(names[0], '< 0.5', f'error: {bad}'), na_row(names[1], '<= 1.1', f'error: {bad}')], {}, 'n/a'
    big,acc,mic = (m[c]['kb']/1024 for c in ('big', 'accum', 'micro'))
    if big == 0 or mic == 0:   # (a fit too small to move the peak: seen with --quick on a GPU machine, 0 KiB added)
        why = f'not measurable: peak added {big:.1f} / {acc:.1f} / {mic:.1f} MiB (batch / ours / micro-batch alone)'
        return [na_row(names[0], '< 0.5', why), na_row(names[1], '<= 1.1', why)], {}, m['big']['method']
    # Memory linear in the batch, M(n) = fixed + a*n: the share of M(b*k) that scales with the batch
    share = (big-mic)/(b*(k-1))*b*k/big if big > 0 else float('nan')
    r1,r2 = acc/big,acc/mic
    goal1 = f'< 0.5 (≈ {1-share*(1-1/k):.2f} from the {share:.0%} activation share)'
    rows = [[names[0], f'{r1:.3f}', goal1, verdict(r1, 0, 0.5)],
            [names[1], f'{r2:.3f}', '<= 1.1', verdict(r2, 0, 1.1)]]
    raw = {f'{c} MiB added': v for c,v in zip((f'batch {b*k}', f'{b} x {k} (ours)', f'{b} alone'), (big,acc,mic))}
    return rows, raw, m['big']['method']

# -- 3. BatchNormAccumulation modes / plain accumulation ------------------------------------------------------------
def bn_section(sz, repeats, warmup):
    goals = dict(pool=1.03)
    b,k = sz['b'],sz['k']
    ds,rows = images(b*k*sz['windows'], sz['px']),[]
    def make(cbs, m=None):
        bs,acc = bn_cut(m, b, k)
        return partial(fit_time, learner(conv_net(sz['width']), ds, bs, [*acc, *cbs]))
    contenders = {'plain': make([]), **{m: make([BatchNormAccumulation(m)], m) for m in BN_MODES}}
    t,errs = rounds(contenders, repeats, warmup)   # a mode that cannot run says so in its row
    if 'plain' in errs: raise RuntimeError(errs['plain'])
    for m in BN_MODES:
        name = f"time/epoch: `BatchNormAccumulation('{m}')` / plain accumulation"
        goal = goals.get(m, None if m in WINDOW_MODES else 1.03)   # (the window modes' passes: measured, no goal)
        if goal is None and m not in errs:
            r,noise = summary([x/y for x,y in zip(t[m], t['plain'])]); rows.append([name, f'{r:.3f} ± {noise:.3f}', 'info', '—'])
        else: rows.append(na_row(name, f'<= {goal:.2f}' if goal else 'info', errs[m]) if m in errs else time_row(name, t[m], t['plain'], goal))
    return rows, {f'BN {n} s/epoch': summary(v) for n,v in t.items() if v}

# -- 4. DDP, 2 CPU processes over gloo: all-reduces and time with and without `no_sync` (bench/ddp_bench.py's runs) --
def _ddp_runs(rank, world, dd, repeats, warmup):
    """`ddp_bench.run`: one fit of an MLP under `GradientAccumulation`, as shipped ('no_sync') or with a DDP whose
    `no_sync` does nothing ('sync_every'); all-reduce rounds counted by a communication hook, wall = slower rank"""
    import ddp_bench
    res = {v: [] for v in ('no_sync', 'sync_every')}
    if warmup: ddp_bench.run(rank, world, dd['k'], dd['b'], 1, dd['hidden'], 'no_sync')
    for r in range(repeats):
        for v in (list(res) if r % 2 == 0 else list(res)[::-1]):
            res[v].append(ddp_bench.run(rank, world, dd['k'], dd['b'], dd['steps'], dd['hidden'], v))
    return res

def ddp_section(dd, repeats, warmup):
    k = dd['k']
    names = (f'DDP all-reduce rounds/epoch: with `no_sync` / without, k={k}', 'DDP time/epoch: with `no_sync` / without')
    res = launch_gloo(_ddp_runs, 2, (dd, repeats, warmup))
    if res is None:
        return [na_row(names[0], f'= 1/{k}', 'error: DDP workers failed'), na_row(names[1], '<= 1.00', 'error')], {}, 'failed'

    a,b = res['no_sync'],res['sync_every']
    r = a[0]['rounds']/b[0]['rounds']
    rows = [[names[0], f"{a[0]['rounds']}/{b[0]['rounds']} = {r:.3f}", f'= 1/{k} = {1/k:.3f}', verdict(abs(r-1/k), 0, 1e-9)],
            time_row(names[1], [x['wall'] for x in a], [x['wall'] for x in b], 1.00)]
    note = f"{a[0]['params']/1e6:.2f}M-parameter MLP, micro-batch {dd['b']} per rank, {a[0]['steps']} steps per fit"
    return rows, {f'DDP {n} s/fit': summary([x['wall'] for x in v]) for n,v in res.items()}, note

# -- 4b. compute ops each BatchNorm mode adds per micro-batch (CPU, whole fits, exact counts: no timing) -------------
class OpCounter:
    "Counts the aten compute ops dispatched while open (a `TorchDispatchMode`); view ops excluded (they launch no kernel)"
    def __init__(self): self.n,self.by_op = 0,{}
    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        counter = self
        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if not func.is_view:
                    counter.n += 1; name = str(func.overloadpacket); counter.by_op[name] = counter.by_op.get(name, 0)+1
                return func(*args, **(kwargs or {}))
        self._mode = _Mode(); self._mode.__enter__(); return self
    def __exit__(self, *exc): self._mode.__exit__(*exc)

OP_GOALS = dict(pool=24, momentum=24)   # extra compute ops per micro-batch, resnet50 (issue 14)

def op_counts(arch='resnet50', px=32, b=2, k=4, windows=2, modes=BN_MODES)->dict:
    """Compute ops per micro-batch of a whole `fit(1)` with plain accumulation, and what each BatchNorm mode adds,
    counted on the CPU: `{'plain': ops, mode: extra ops, 'n_bn': BatchNorm layers}`"""
    import torchvision
    ds = images(b*k*windows, px)
    def count(cbs, m=None):
        torch.manual_seed(0)
        bs,acc = bn_cut(m, b, k)
        learn = learner(torchvision.models.get_model(arch, num_classes=10), ds, bs, [*acc, *cbs])
        with OpCounter() as c: fit_time(learn)
        return c.n/(k*windows)
    plain = count([])
    n_bn = sum(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in torchvision.models.get_model(arch).modules())
    return dict(plain=plain, n_bn=n_bn, **{m: count([BatchNormAccumulation(m)], m) - plain for m in modes})

def op_section(quick=False):
    archs = ('resnet18',) if quick else ('resnet18', 'resnet50')
    got = {a: op_counts(a, px=16 if quick else 32, k=2 if quick else 4, windows=1 if quick else 2) for a in archs}
    rows = []
    for a,c in got.items():
        for m in BN_MODES:
            goal = OP_GOALS.get(m)
            name = f"ops/micro-batch added by `BatchNormAccumulation('{m}')`, {a} ({c['n_bn']} BN layers; plain {c['plain']:.0f})"
            if goal is None: rows.append([name, f"{c[m]:+.1f} ({c[m]/c['n_bn']:+.1f} per BN layer)", 'info', '—'])
            else: rows.append([name, f'{c[m]:+.1f}', f'<= {goal}', verdict(c[m], 0, goal)])
    if len(got) == 2:
        d = max(abs(got['resnet50'][m]-got['resnet18'][m]) for m in OP_GOALS)
        rows.append(["ops/micro-batch added by 'pool'/'momentum': resnet50 - resnet18 (does not grow with the BN layers)",
                     f'{d:.1f}', '<= 4', verdict(d, 0, 4)])
    return rows, got

# -- 5. CUDA: resnet18 / resnet50 at 224 px, micro-batch b x k against batch b*k (or the largest that fits) ----------
CUDA_SIZES = dict(default=dict(arch='resnet50', px=224, b=32, k=8, windows=2), quick=dict(arch='resnet18', px=32, b=2, k=2, windows=1))
CUDA_GOALS = dict(pool=1.03, momentum=1.03, freeze=1.03, groupnorm=None, renorm=1.25, window=None, **{'window-approx': None})

def cuda_section(device='cuda', arch='resnet50', px=224, b=32, k=8, windows=2, repeats=3, warmup=True):
    """On a GPU: images/s of ours, fastai's `GradientAccumulation`, a hand-written loop and the big batch (fp16 through
    fastai's `MixedPrecision` / autocast + GradScaler), peak memory added (`max_memory_allocated`), and every BatchNorm
    mode against plain accumulation. On a CPU `device` only the code path runs (fp32, memory n/a)."""
    import torchvision
    from fastai.callback.fp16 import MixedPrecision
    device = torch.device(device); cuda = device.type == 'cuda'
    ds = images(b*k*windows, px)
    def amp(): return [MixedPrecision()] if cuda else []   # one per Learner: a callback holds its Learner in `.learn`
    def model(**kw): torch.manual_seed(0); return torchvision.models.get_model(arch, num_classes=10, **kw).to(device)
    def lrn(bs, cbs, **kw):
        learn = learner(model(**kw), ds, bs, cbs + amp(), device=device, prebatched=True)
        if cuda: learn.add_cb(CudaSync())
        return learn
    learners = dict(ours=lrn(b, [GradientAccumulation(n_step=k)]), fastai=lrn(b, [FastaiGA(b*k)]), big=lrn(b*k, []),
                    **{m: lrn(bn_cut(m, b, k)[0], [*bn_cut(m, b, k)[1], BatchNormAccumulation(m)]) for m in BN_MODES},
                    # the same architecture built with GroupNorm from the start (what 'groupnorm' converts to)
                    native_gn=lrn(b, [GradientAccumulation(n_step=k)], norm_layer=lambda c: torch.nn.GroupNorm(32, c)))
    mem = {}
    for n,l in learners.items():   # the first (warm-up) fit of each, measured for memory
        if cuda: torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
        fit_time(l)
        if cuda: torch.cuda.synchronize(); mem[n] = (torch.cuda.max_memory_allocated()-base)/2**20
    hand = model()
    contenders = {n: partial(fit_time, l) for n,l in learners.items()}
    contenders['hand'] = hand_loop(hand, ds, b, k, device, amp=cuda, prebatched=True)
    t,errs = rounds(contenders, repeats, warmup)
    label = f'{arch} {px}px{" fp16" if cuda else ""}, micro-batch {b} x {k}'
    def row(name, num, den, goal):
        if num in errs or den in errs: return [name, errs.get(num) or errs.get(den), '—', '—']
        if goal is None:
            r,noise = summary([x/y for x,y in zip(t[num], t[den])]); return [name, f'{r:.3f} ± {noise:.3f}', 'info', '—']
        return time_row(name, t[num], t[den], goal)
    rows = [row(f'CUDA {label}: time/epoch ours / fastai `GradientAccumulation`', 'ours', 'fastai', 1.0),
            row(f'CUDA {label}: time/epoch ours / hand-written loop', 'ours', 'hand', 1.05),
            row(f'CUDA {label}: time/epoch ours / batch {b*k}', 'ours', 'big', None)]
    rows.append([f'CUDA {label}: memory / batch {b*k}', f"{mem['ours']/mem['big']:.3f}" if cuda else 'n/a (not a CUDA device)',
                 '< 0.5', verdict(mem['ours']/mem['big'], 0, 0.5) if cuda else '—'])
    rows += [row(f"CUDA {label}: time/epoch `BatchNormAccumulation('{m}')` / plain accumulation", m, 'ours', CUDA_GOALS[m])
             for m in BN_MODES]
    rows += [row(f"CUDA {label}: time/epoch 'groupnorm' (converted) / the model built with nn.GroupNorm", 'groupnorm', 'native_gn', 1.03),
             row(f"CUDA {label}: time/epoch nn.GroupNorm model / BatchNorm model (GroupNorm's own cost)", 'native_gn', 'ours', None)]
    n_img = len(ds)
    raw = {f'{n}': (n_img/summary(v)[0] if v else float('nan'), mem.get(n, float('nan'))) for n,v in t.items()}
    return rows, raw

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--quick', action='store_true', help='tiny sizes and one repeat (smoke test; the ratios mean nothing)')
    p.add_argument('--repeats', type=int, default=None, help='timed rounds per contender (default 7; 1 with --quick)')
    p.add_argument('--out', help='also write the markdown to this file')
    p.add_argument('--no-ddp', action='store_true', help='skip the 2-process DDP rows')
    p.add_argument('--threads', type=int, default=1, help='torch CPU threads (default 1: on a shared CPU, OpenMP threads '
                   'spin-waiting on a busy core slow an epoch by up to 30x and drown the ratios)')
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    sz,repeats = SIZES['quick' if args.quick else 'default'],args.repeats or (1 if args.quick else 7)
    t0,started = time.perf_counter(),datetime.datetime.now().strftime('%Y-%m-%d %H:%M')
    mach,warmup = machine(),not args.quick   # the machine first (the load average)
    def section(name, f, *a, **kw):
        t = time.perf_counter(); res = f(*a, **kw)
        print(f'bench: {name} done in {time.perf_counter()-t:.0f} s', file=sys.stderr, flush=True)
        return res
    # Processes fork before this one runs a tensor op (an OpenMP pool is not fork-safe): memory, then DDP, then timings
    mem_rows,mem_raw,method = section('memory', memory_section, sz)
    if args.no_ddp: ddp_rows,ddp_raw,ddp_note = [na_row('DDP', '—', 'skipped (--no-ddp)')],{},'skipped'
    else: ddp_rows,ddp_raw,ddp_note = section('DDP', ddp_section, sz['ddp'], repeats, warmup)
    speed_rows,speed_raw = section('time', speed_section, sz, repeats, warmup)
    bn_rows,bn_raw = section('BatchNorm', bn_section, sz, repeats, warmup)
    op_rows,op_raw = section('op counts', op_section, args.quick)
    if torch.cuda.is_available():
        cuda_rows,cuda_raw = section('CUDA', cuda_section, 'cuda', **CUDA_SIZES['quick' if args.quick else 'default'],
                                     repeats=repeats if args.quick else min(repeats, 3), warmup=warmup)
    else: cuda_rows,cuda_raw = [na_row('CUDA resnet50 224px fp16: time, images/s, memory, BatchNorm modes', '—', 'skipped: no CUDA device')],{}
    b,k = sz['b'],sz['k']
    cmd = ' '.join(['python bench/bench.py', *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    raw = {**speed_raw, **bn_raw, **ddp_raw}
    md = '\n'.join([
        f'## Benchmark ({started})', '',
        table(speed_rows + mem_rows + bn_rows + op_rows + ddp_rows + cuda_rows), '',
        f'- machine: {mach}',
        f'- command: `{cmd}`'
        f' ({time.perf_counter()-t0:.0f} s wall)',
        f'- setup: conv net (4 conv-BN-ReLU blocks, width {sz["width"]}), {sz["px"]}px random images, micro-batch {b}, '
        f'k = {k} micro-batches per window ({b*k} items), {sz["windows"]} windows per epoch, SGD (momentum {MOM}) '
        'through `OptimWrapper` in every Learner; time = training phase of one epoch, no progress bar or logging',
        f'- timing: {repeats} timed round(s){" after a warm-up round" if warmup else ""}, contenders alternating '
        '(order rotating); ratio = median '
        'of the per-round ratios ± 1.4826 x MAD; "within noise" = missed by less than that spread',
        f'- memory: {method} added by `fit` in a fresh process per configuration over its baseline after model and data; '
        + ', '.join(f'{n} {v:.1f}' for n,v in mem_raw.items()),
        f'- DDP: `bench/ddp_bench.py` runs, 2 CPU processes over gloo, 1 thread each, {ddp_note}; "without" = a DDP whose '
        '`no_sync` does nothing (every micro-batch all-reduces, as with fastai\'s callback); time = slower rank\'s fit',
        '- medians (s ± spread): ' + ', '.join(f'{n} {m:.3f} ± {s:.3f}' for n,(m,s) in raw.items()),
        '- op counts: aten compute ops (view ops excluded) dispatched per micro-batch over a whole `fit(1)` on the CPU, '
        f'torchvision models at {16 if args.quick else 32}px, micro-batch 2 x {2 if args.quick else 4}; plain: '
        + ', '.join(f"{a} {c['plain']:.0f}" for a,c in op_raw.items()),
    ] + (['- CUDA ' + (torch.cuda.get_device_name() if torch.cuda.is_available() else '') + f', torch {torch.__version__}, '
          f'CUDA {torch.version.cuda} (images/s, peak MiB added by fit): ' + ', '.join(f'{n} {i:.0f} img/s, {m:.0f} MiB' for n,(i,m) in cuda_raw.items())]
         if cuda_raw else []))
    print(md)
    if args.out:
        with open(args.out, 'w') as f: f.write(md + '\n')
    return md

if __name__ == '__main__': main()
