"""What the recommended callbacks add to plain accumulation on small models, where a fixed cost per micro-batch or per
window shows most (issue 38): `BatchNormAccumulation('pool')` and `GradientNoiseScale()`, side by side in one run.

The bars' small conv net (bench/bench.py's `conv_net`: four conv + BatchNorm blocks), micro-batch 16 x n_step 8,
`--windows` optimizer steps an epoch, SGD: one Learner per contender (plain accumulation, + 'pool', + the noise scale),
each fitted for one epoch per round, the order rotating every round after a warm-up round. Printed: the median of the
per-round ratios to plain accumulation ± 1.4826 x MAD (goals: 'pool' <= 1.03, noise <= 1.02), and what each adds per
window in microseconds two ways: the median over rounds of its epoch minus plain's, over the windows (an epoch's
noise is in it), and the time spent inside the callback's own code (its event methods, and 'pool''s forward hooks and
window close), timed call by call in a separate instrumented epoch (on a CPU every op is synchronous, so that is its
whole cost there), with the machine.

    python bench/overhead.py [--rounds 9] [--windows 8] [--width 32] [--threads 1]"""
import argparse, statistics, warnings
from functools import partial

warnings.filterwarnings('ignore')
import torch
from common import conv_net, fit_time, images, learner, machine, rounds, summary, table, time_row

from accum_callback import BatchNormAccumulation, GradientAccumulation, GradientNoiseScale

GOALS = {'pool': 1.03, 'noise': 1.02}

def instrumented(learn, cb)->float:
    """Seconds spent inside `cb`'s event methods and (a `BatchNormAccumulation`) its banks' forward hooks and window
    closes, over one epoch of `learn`"""
    import time
    from fastai.callback.core import _events
    from accum_callback.batchnorm.callback import PooledStats
    spent = [0.]
    def timed(f):
        def g(*a, **k):
            t = time.perf_counter()
            try: return f(*a, **k)
            finally: spent[0] += time.perf_counter() - t
        return g
    for e in _events:
        f = getattr(type(cb), e, None)
        if callable(f): setattr(cb, e, timed(getattr(cb, e)))
    hooks,close = PooledStats.hooks,PooledStats.close
    PooledStats.hooks = lambda self, l: tuple(timed(h) for h in hooks(self, l))
    PooledStats.close = timed(close)
    try: fit_time(learn)
    finally:
        PooledStats.hooks,PooledStats.close = hooks,close
        for e in _events: cb.__dict__.pop(e, None)
    return spent[0]

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--rounds', type=int, default=9)
    p.add_argument('--windows', type=int, default=8, help='optimizer steps an epoch (default 8)')
    p.add_argument('--width', type=int, default=32, help="the conv net's first channels (default 32, the bars')")
    p.add_argument('--b', type=int, default=16); p.add_argument('--k', type=int, default=8)
    p.add_argument('--threads', type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    ds = images(a.b*a.k*a.windows, 32)
    def make(cbs): return partial(fit_time, learner(conv_net(a.width), ds, a.b, [GradientAccumulation(n_step=a.k), *cbs]))
    cbs = {'pool': BatchNormAccumulation('pool'), 'noise': GradientNoiseScale()}
    contenders = {'plain': make([]), **{n: make([cb]) for n,cb in cbs.items()}}
    t,errs = rounds(contenders, a.rounds)
    if errs: raise RuntimeError(errs)
    rows,per_window = [],{}
    for n,name in (('pool', "`BatchNormAccumulation('pool')`"), ('noise', '`GradientNoiseScale()`')):
        rows.append(time_row(f'time/epoch: {name} / plain accumulation', t[n], t['plain'], GOALS[n]))
        per_window[n] = summary([1e6*(x - y)/a.windows for x,y in zip(t[n], t['plain'])])
    print(machine())
    print(f"conv_net(width={a.width}) 32 px, micro-batch {a.b} x n_step {a.k}, {a.windows} windows an epoch, "
          f"{a.threads} thread(s), {a.rounds} rounds (+1 warm-up), order rotating")
    print(table(rows))
    print('- added per window, epochs against plain (µs, median ± spread): ' + ', '.join(f'{n} {m:.0f} ± {s:.0f}' for n,(m,s) in per_window.items()))
    inside = {n: [1e6*instrumented(contenders[n].args[0], cb)/a.windows for _ in range(3)] for n,cb in cbs.items()}
    print("- inside the callback's own code per window (µs, median of 3 instrumented epochs): " +
          ', '.join(f'{n} {statistics.median(v):.0f}' for n,v in inside.items()) +
          f"; an epoch of plain accumulation is {1e6*summary(t['plain'])[0]/a.windows:.0f} µs a window")
    print('- medians (s/epoch ± spread): ' + ', '.join(f'{n} {summary(v)[0]:.3f} ± {summary(v)[1]:.3f}' for n,v in t.items()))

if __name__ == '__main__': main()
