"""What the tests and the bench scripts share: a gloo launcher that runs a function on several CPU processes, a free
port, a loss that runs out of memory as a GPU would, and synthetic data. Public torch API only; fastai is not needed.

    from accum_callback.testing import launch_gloo, OutOfMemoryAbove, regression_data

`launch_gloo(fn, world=2)` runs `fn(rank, world, ...)` in `world` processes joined in one gloo process group and
returns each rank's result; a rank that fails raises here with its traceback, and a rank that waits in a collective
the others skipped fails after `timeout` seconds instead of hanging."""
from __future__ import annotations
import datetime, gc, os, socket, sys, tempfile, time, traceback

import torch
from torch.utils.data import TensorDataset

__all__ = ['free_port', 'launch_gloo', 'OutOfMemoryAbove', 'regression_data', 'image_data']

# -- processes
# ----------------------------------------------------------------------------------------------------------
def free_port()->int:
    "A TCP port free on this machine now (for a process group's rendezvous)"
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); return s.getsockname()[1]

def _rank_entry(rank:int, world:int, port:int, threads:int, timeout:float, d:str, fn, args, kwargs):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(threads)
    code = 1
    try:
        # A short collective timeout: a rank that skips a collective the other makes fails instead of hanging
        dist.init_process_group('gloo', rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout))
        try:
            torch.save(fn(rank, world, *args, **kwargs), os.path.join(d, f'{rank}.pt'))
            dist.barrier()   # neither rank tears its side down while the other may still be talking to it
            code = 0
        finally:
            # A Learner sits in reference cycles (its callbacks point back to it), so the DDP/FSDP wrappers it made hold
            # the process group until the cyclic collector runs, possibly at interpreter shutdown, where gloo's worker
            # threads then abort the process (SIGABRT, seen once in CI). Collect them now, while the interpreter is
            # whole.
            gc.collect()
            dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(d, f'{rank}.err'), 'w') as f: f.write(traceback.format_exc())
    # The result (or the error) is on disk and the group is gone: leave without the interpreter's teardown
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(code)

def launch_gloo(fn, world:int=2, args:tuple=(), kwargs:dict|None=None, threads:int=1, timeout:float=60,
                start:str='spawn')->list:
    """Run `fn(rank, world, *args, **kwargs)` in `world` CPU processes joined in one gloo process group (`RANK`,
    `WORLD_SIZE`, `LOCAL_RANK`, ... set as torchrun sets them), `threads` torch threads each; return each rank's result.
    `timeout`: seconds a collective may wait. `start`: 'spawn' (fresh interpreters: `fn` must be importable by name)
    or 'fork' (faster to start; `fn` may be any module-level function of a script). A rank that fails stops the others
    and raises a `RuntimeError` here with its traceback."""
    import multiprocessing
    if start == 'fork' and 'fork' not in multiprocessing.get_all_start_methods(): start = 'spawn'
    ctx = multiprocessing.get_context(start)
    with tempfile.TemporaryDirectory() as d:
        port = free_port()
        ps = [ctx.Process(target=_rank_entry, args=(r, world, port, threads, timeout, d, fn, tuple(args),
                                                    dict(kwargs or {})))
              for r in range(world)]
        # CPU processes: a GPU on the machine stays out of them (fastai and `to_fsdp` would otherwise put models there)
        hidden = os.environ.get('CUDA_VISIBLE_DEVICES')
        os.environ['CUDA_VISIBLE_DEVICES'] = ''
        try:
            for p in ps: p.start()
        finally:
            if hidden is None: del os.environ['CUDA_VISIBLE_DEVICES']
            else: os.environ['CUDA_VISIBLE_DEVICES'] = hidden
        failed = None
        while any(p.is_alive() for p in ps):
            failed = next((r for r,p in enumerate(ps) if p.exitcode not in (None, 0)), None)
            if failed is not None: break
            time.sleep(0.02)
        if failed is None: failed = next((r for r,p in enumerate(ps) if p.exitcode != 0), None)
        if failed is not None:
            time.sleep(0.5)   # the others may be writing their own error
            for p in ps:
                if p.is_alive(): p.terminate()
            for p in ps: p.join()
            errs = [(r, open(os.path.join(d, f'{r}.err')).read()) for r in range(world)
                    if os.path.exists(os.path.join(d, f'{r}.err'))]
            errs.sort(key=lambda e: e[0] != failed)   # the rank that failed first: the others' errors follow from it
            first = errs[0] if errs else (failed, f'exit code {ps[failed].exitcode}, no traceback (killed?)')
            raise RuntimeError(f'rank {first[0]} of {world} failed in {getattr(fn, "__name__", fn)}:\n{first[1]}')
        for p in ps: p.join()
        return [torch.load(os.path.join(d, f'{r}.pt'), weights_only=False) for r in range(world)]

# -- a simulated device
# -------------------------------------------------------------------------------------------------
class OutOfMemoryAbove:
    """A loss (`loss`, default mean squared error) that raises `torch.OutOfMemoryError`, as a GPU would, for a batch of
    more than `n` items: in training (gradients enabled, `phase='train'`) or in inference (`phase='valid'`), on every
    rank or on rank `rank` only. `calls`: the item counts it saw in its phase; `hits`: the errors it raised; `enabled =
    False` gives the device room (nothing is refused)"""
    def __init__(self, n:int, loss=None, phase:str='train', rank:int|None=None):
        if phase not in ('train', 'valid'): raise ValueError(f"`phase` must be 'train' or 'valid', got {phase!r}")
        self.n,self.loss,self.phase,self.rank,self.calls,self.hits,self.enabled = n,loss,phase,rank,[],0,True
    def refuses(self, k:int)->bool:
        "Is a batch of `k` items refused here and now (right phase and rank; the count is recorded)?"
        if not self.enabled or torch.is_grad_enabled() != (self.phase == 'train'): return False
        if self.rank is not None:
            import torch.distributed as dist
            if (dist.get_rank() if dist.is_available() and dist.is_initialized() else 0) != self.rank: return False
        self.calls.append(k)
        return k > self.n
    def refuse(self, k:int):
        self.hits += 1
        raise torch.OutOfMemoryError(f'CUDA out of memory (simulated: {k} items > {self.n}, {self.phase})')
    def __call__(self, out, *yb, **kw):
        if self.refuses(len(out)): self.refuse(len(out))
        if self.loss is None: return torch.nn.functional.mse_loss(out, *yb, **kw)
        return self.loss(out, *yb, **kw)

# -- data
# ---------------------------------------------------------------------------------------------------------------
def regression_data(n:int, n_in:int=5, n_out:int=3, seed:int=0, classify:bool=False,
                    dtype=torch.float32)->TensorDataset:
    """`n` items `x ~ N(0, 1)` of `n_in` features, `y = x @ W + 0.1 noise` (or `classify`: labels in `[0, n_out)`), in
    `dtype`"""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, n_in, generator=g, dtype=dtype)
    if classify: y = torch.randint(0, n_out, (n,), generator=g)
    else:
        y = x @ torch.randn(n_in, n_out, generator=g, dtype=dtype) + 0.1*torch.randn(n, n_out, generator=g, dtype=dtype)
    return TensorDataset(x, y)

def image_data(n:int, px:int, seed:int=0, n_out:int=10)->TensorDataset:
    "`n` random 3-channel `px` x `px` images and labels in `[0, n_out)`"
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, px, px, generator=g), torch.randint(0, n_out, (n,), generator=g))
