"""What the job's default BatchNorm setting costs (issue 38): `--bn auto` ('pool' with the statistics recomputed from
512 training items) at every epoch's end with 0.2.0's recomputation (its code is kept below, verbatim: a hook's
`var_mean` over each BatchNorm input), at every epoch's end with today's (each plain BatchNorm layer's own statistics
read back), at the last epoch's end only (today's default), and 'pool' without any recomputation, side by side in one
run: the job's defaults (digits transfer task, resnet_tiny pretrained, or `--scratch`: random weights, loader batch 4 x
8 = 32 a step, one-cycle 3e-3, 3 epochs), the same seeds, settings alternating within each round (rotating which goes
first). Printed per setting: the training time (the fit's loops, `learn.throughput.secs`), the final accuracy per
seed, and the recomputation's cost as a fraction of training without it.

    python bench/job_precise.py --seeds 3 --rounds 3 [--scratch]
"""
import argparse, contextlib, statistics, time, warnings

SETTINGS = {'every epoch, 0.2.0 code': dict(bn_precise=512, precise_at='epoch', code='0.2.0'),
            'every epoch': dict(bn_precise=512, precise_at='epoch'),
            'last epoch (default)': dict(bn_precise=512, precise_at='end'),
            'none': dict(bn_precise=None, precise_at='end')}

def _old_code():
    """0.2.0's recomputation (as it was until this round, verbatim below): a hook computes each BatchNorm input's
    `var_mean` (a second pass over the activations) and each micro-batch is pooled into float64 sums at once"""
    import contextlib, torch, torch.nn as nn, torch.distributed as dist
    import accum_callback.batchnorm.precise as P
    g = dict(vars(P)); g.update(contextlib=contextlib, torch=torch, nn=nn, dist=dist)
    exec(compile(_SOURCE_020, 'precise.py (0.2.0)', 'exec'), g)
    return g['_precise_bn_stats_020']

@contextlib.contextmanager
def _code(which):
    import accum_callback.batchnorm.precise as P
    if which != '0.2.0': yield; return
    new,P.precise_bn_stats = P.precise_bn_stats,_old_code()
    try: yield
    finally: P.precise_bn_stats = new

def _job_learner(setting, seed, scratch=False):
    from accum_finetune.data import digits_dls
    from accum_finetune.finetune import build_learner
    from accum_finetune.models import DEFAULT_ARCH
    from accum_finetune.pretrain import pretrained_checkpoint
    kw = {k: v for k,v in SETTINGS[setting].items() if k != 'code'}
    weights = None if scratch else str(pretrained_checkpoint())
    return build_learner(digits_dls(4, seed=seed), DEFAULT_ARCH, weights=weights, n_step=8, bn='pool', seed=seed, **kw)

def run(setting, seed, epochs, scratch=False):
    from accum_finetune.finetune import finetune
    learn = _job_learner(setting, seed, scratch)
    with _code(SETTINGS[setting].get('code')): m = finetune(learn, epochs, 3e-3, progress=False)
    return learn.throughput.secs,m['accuracy']   # (the training loops' time, unrounded)

def recompute_ab(rounds:int=11, scratch=False)->tuple:
    """One recomputation of 512 items on the job's trained-for-one-epoch Learner, 0.2.0's code against today's, alternating
    (rotating which goes first): (median ratio today's/0.2.0's, its spread, 0.2.0's median s, today's median s)"""
    import torch
    from common import summary
    from accum_callback import update_bn_stats
    from accum_callback.micro import micro_size
    from accum_callback.batchnorm.precise import training_items
    import accum_callback.batchnorm.precise as P
    learn = _job_learner('none', 0, scratch)
    learn.fit(1)
    old,new = _old_code(),P.precise_bn_stats
    def once(f):
        P.precise_bn_stats = f
        try:
            t = time.perf_counter(); update_bn_stats(learn.model, training_items(learn, 512, micro_size(learn)))
            return time.perf_counter() - t
        finally: P.precise_bn_stats = new
    once(old); once(new)   # warm-up
    to,tn = [],[]
    for r in range(rounds):
        for f,ts in ((old, to), (new, tn))[::1 if r % 2 else -1]: ts.append(once(f))
    m,spread = summary([b/a for a,b in zip(to, tn)])
    return m,spread,statistics.median(to),statistics.median(tn)

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--seeds', type=int, default=3)
    p.add_argument('--rounds', type=int, default=2, help='runs of every (setting, seed), alternating')
    p.add_argument('--epochs', type=int, default=3)
    p.add_argument('--threads', type=int, default=None)
    p.add_argument('--scratch', action='store_true', help="from random weights (the BatchNorm study's from-scratch case)")
    p.add_argument('--recompute-only', action='store_true', help='only time one recomputation, 0.2.0 code against today')
    a = p.parse_args(argv)
    warnings.filterwarnings('ignore')
    import torch
    if a.threads: torch.set_num_threads(a.threads)
    from common import machine
    if a.recompute_only:
        r,sp,to,tn = recompute_ab(scratch=a.scratch)
        print(f"{machine()}\none recomputation of 512 items, 11 alternating rounds: today's / 0.2.0's {r:.3f} ± {sp:.3f} "
              f"({tn:.3f} s against {to:.3f} s, medians)")
        return
    names = list(SETTINGS)
    secs,accs = {k: [] for k in names},{k: {} for k in names}
    run(names[0], 0, 1)   # warm-up: imports, allocator, the pretrained checkpoint
    for r in range(a.rounds):
        for seed in range(a.seeds):
            order = names[(r+seed) % len(names):] + names[:(r+seed) % len(names)]
            for k in order:
                t,acc = run(k, seed, a.epochs, a.scratch)
                secs[k].append(t); accs[k][seed] = acc
    print(f"{machine()} ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
    print(f"`python bench/job_precise.py --seeds {a.seeds} --rounds {a.rounds}{' --scratch' if a.scratch else ''}`: the job's defaults"
          f"{' from random weights' if a.scratch else ''}, {a.epochs} epochs, "
          f"medians of {a.rounds*a.seeds} runs each\n")
    none = statistics.median(secs['none'])
    print("| BatchNorm statistics | training s (median) | recomputation's cost (of training without) | accuracy per seed | mean |")
    print("|---|---:|---:|---|---:|")
    for k in names:
        t = statistics.median(secs[k])
        acc = [accs[k][s] for s in range(a.seeds)]
        print(f"| {k} | {t:.2f} | {'-' if k == 'none' else f'{t/none-1:+.1%}'} | {', '.join(f'{x:.4f}' for x in acc)} | {statistics.mean(acc):.4f} |")
    old,e,new = (statistics.median(secs[k]) for k in names[:3])
    print(f"\ntoday's default (last epoch) / 0.2.0's (every epoch, 0.2.0 code): {new/old:.3f} of the training time "
          f"({old/new:.2f}x faster; at most {old/none:.2f}x: no recomputation at all)")
    print(f"every epoch, today's code / 0.2.0's code: {e/old:.3f}; one recomputation, today's / 0.2.0's: {(e-none)/(old-none):.3f}")
    r,sp,to,tn = recompute_ab(scratch=a.scratch)
    print(f"one recomputation of 512 items timed alone, 11 alternating rounds: today's / 0.2.0's {r:.3f} ± {sp:.3f} "
          f"({tn:.3f} s against {to:.3f} s, medians)")


_SOURCE_020 = '''@torch.no_grad()
def _precise_bn_stats_020(model:nn.Module, batches, forward=None, ctx=contextlib.nullcontext, layers:list|None=None)->dict:
    """`{layer: PopulationStats}` of the inputs of the BatchNorm `layers` (default `trained_bn_layers(model)`: those
    training updates, not the ones frozen in eval mode) over `batches` (each an input or a tuple of inputs to `forward`,
    default `model(*xb)`), run with those layers in training mode (each micro-batch normalised by its own statistics)
    and everything else in eval mode (no dropout; frozen BatchNorm layers normalise with their running statistics, as
    in training). The statistics are float64 sums of each micro-batch's statistics, computed in the input's precision
    (float32 at least). Nothing of the model changes: modes, buffers and Batch Renorm's step counters are put back, and
    every RNG. `ctx()` wraps each forward (autocast, say). Under DDP or FSDP2 (a sharded model or a running process
    group with a distributed `model`) the statistics are every rank's: every rank must pass the same number of batches."""
    forward = forward or (lambda xb: model(*xb))
    bns = trained_bn_layers(model) if layers is None else list(layers)
    n_items = 0
    stats = _Stats({bn: PopulationStats() for bn in bns})
    modes = [(m, m.training) for m in model.modules()]
    bufs = [(t, t.detach().clone()) for bn in bns for t in (bn.running_mean, bn.running_var, bn.num_batches_tracked) if t is not None]
    steps = [(m, m.renorm_steps) for m in bns if hasattr(m, 'renorm_steps')]
    def hook(bn):
        def pre(mod, inp):
            x = inp[0]
            dims = [0] + list(range(2, x.ndim))
            var,mean = torch.var_mean(x if x.dtype == torch.float64 else x.float(), dim=dims, correction=0)
            stats[mod].update(mean, var, x.numel()//x.shape[1])
        return bn.register_forward_pre_hook(pre)
    handles = [hook(bn) for bn in bns]
    try:
        with rngs_kept():
            model.eval()
            for bn in bns: bn.train()
            for xb in batches:
                xb = xb if isinstance(xb, (tuple, list)) else (xb,)
                with ctx(): forward(xb)
                n_items += xb[0].shape[0]
    finally:
        for h in handles: h.remove()
        for m,t in modes: m.training = t
        for t,v in bufs: t.copy_(v)
        for m,k in steps: m.renorm_steps = k
    if is_distributed(model) and dist.is_available() and dist.is_initialized():
        for s in stats.values():
            if s.s1 is not None: s.sum_over_ranks()
        t = torch.tensor([float(n_items)], dtype=torch.float64, device=next(iter(stats)).running_mean.device if stats else 'cpu')
        dist.all_reduce(t); n_items = int(t.item())
    stats.n_items = n_items
    return stats
'''

if __name__ == '__main__': main()
