"""`GradientAccumulation` under DistributedDataParallel: 2 CPU processes over gloo, all-reduces counted by a DDP
communication hook. Every scenario runs in one spawn (`ddp_worker.run_many`): starting the processes costs far more
than the scenarios. The model is float64, SGD, so "equal" means to 1e-6 relative (seen: ~1e-16)."""
import importlib.util, re
import pytest, torch

import ddp_worker as W
from helpers import HAS_FSDP2, needs_fsdp2, rel_err
from accum_callback.core.distributed import count_allreduces
from accum_callback.testing import launch_gloo

TOL = 1e-6
# sizes: samples on each rank; bs 4, 2 epochs; [14, 16]: rank 0's last batch holds 2 samples, rank 1's 4
SCENARIOS = dict(
    n_step4       = dict(sizes=[32,32], ga=dict(n_step=4)),
    sync_every    = dict(sizes=[32,32], ga=dict(n_step=4), ddp=W.SyncEveryDDP),  # ours, but DDP ignores no_sync
    fastai_accum  = dict(sizes=[32,32], ga=dict(fastai_builtin=16)),             # fastai's GradientAccumulation
    uneven        = dict(sizes=[14,16], ga=dict(n_step=4)),
    tokens        = dict(sizes=[16,16], ga=dict(n_step=4), tokens=[0.2,0.9]),    # n_items: rank 1 has ~3x the tokens
    target8_drop  = dict(sizes=[14,16], ga=dict(target_bs=8, partial='drop')),
    target12_drop = dict(sizes=[14,16], ga=dict(target_bs=12, partial='drop')),
    target12_carry= dict(sizes=[14,16], ga=dict(target_bs=12, partial='carry')),
    target12_step = dict(sizes=[14,16], ga=dict(target_bs=12, partial='step')),
    n_step3_carry = dict(sizes=[14,16], ga=dict(n_step=3, partial='carry')),
    fastai_path   = dict(fastai_path=True, n=32, ga=dict(n_step=4)),              # learn.distrib_ctx(): Accelerate + DistributedDL
    fastai_path_n2= dict(fastai_path=True, n=32, ga=dict(n_step=2)),
    fastai_path_micro2 = dict(fastai_path=True, n=32, ga=dict(n_step=2, micro_bs=2)),   # fastai's DistributedDL, then cut
    # issue 43: DistributedDL's `len` (ceil(floor(n/bs)/world)) overstates what a rank reads (floor(ceil(n/world)/bs))
    # with drop_last=True: the epoch's last window used to be dropped (and at 60/8/4 no step was ever taken)
    fastai_path_69_4_3 = dict(fastai_path=True, n=69, bs=4, drop_last=True, ga=dict(n_step=3)),
    fastai_path_60_8_4 = dict(fastai_path=True, n=60, bs=8, drop_last=True, ga=dict(n_step=4)),
    fastai_path_69_micro = dict(fastai_path=True, n=69, bs=4, drop_last=True, ga=dict(n_step=3, micro_bs=2)),
    # per-rank BatchNorm (rank 1's inputs shifted: its statistics differ), BatchNormAccumulation('pool')
    bn_pool       = dict(sizes=[32,32], ga=dict(n_step=4), bn='pool', shift=1.),
    bn_pool_uneven= dict(sizes=[14,16], ga=dict(n_step=4), bn='pool', shift=1.),
    # micro_bs: loader batches of 8 cut into micro-batches; 'auto' with an out-of-memory error on rank 1 only
    micro3        = dict(sizes=[28,32], bs=8, ga=dict(n_step=2, micro_bs=3)),
    auto_oom_rank1= dict(sizes=[32,32], bs=8, ga=dict(micro_bs='auto'), oom=(1, 3)),
    # 'auto': a callback on rank 1 only cancels a micro-batch before its backward (it hung the other rank for ever);
    # and the same at the micro-batch where rank 0 runs out of memory
    auto_cancel_rank1= dict(sizes=[32,32], bs=8, ga=dict(n_step=2, micro_bs='auto'), cancel=(1, 3)),
    auto_cancel_oom  = dict(sizes=[32,32], bs=8, ga=dict(micro_bs='auto'), oom=(0, 4), cancel=(1, 1)),
    # issue 21: learn.check_accumulation() under DDP, each rank on its own samples (rank 0's BatchNorm model too)
    check_ddp        = dict(sizes=[32,32], ga=dict(n_step=4), check=True),
    check_ddp_bn     = dict(sizes=[32,32], ga=dict(n_step=4), bn='pool', shift=1., check=True),
    # issue 22: FSDP2 (`fully_shard` per Linear, then the root, over a CPU mesh), each rank its own data
    fsdp_n4          = dict(sizes=[32,32], ga=dict(n_step=4), fsdp=True),
    fsdp_sharded     = dict(sizes=[32,32], ga=dict(n_step=4, sharded_grads=True), fsdp=True),
    fsdp_gathered    = dict(sizes=[32,32], ga=dict(n_step=4, gathered_params=True), fsdp=True),
    # (0.2's spelling: FSDP2's options given to GradientAccumulation, with a FutureWarning; the same run)
    fsdp_uneven      = dict(sizes=[14,16], ga=dict(n_step=4), fsdp=True),
    fsdp_tokens      = dict(sizes=[14,16], ga=dict(n_step=4), tokens=[0.2,0.9], fsdp=True),
    fsdp_t12_drop    = dict(sizes=[14,16], ga=dict(target_bs=12, partial='drop'), fsdp=True),
    fsdp_t12_carry   = dict(sizes=[14,16], ga=dict(target_bs=12, partial='carry'), fsdp=True),
    fsdp_n3_step     = dict(sizes=[14,16], ga=dict(n_step=3, partial='step'), fsdp=True),
    fsdp_clip        = dict(sizes=[32,32], ga=dict(n_step=4), fsdp=True, cbs_extra=[W.clip]),
    ddp_clip         = dict(sizes=[32,32], ga=dict(n_step=4), cbs_extra=[W.clip]),
    fsdp_bf16        = dict(sizes=[32,32], ga=dict(n_step=4), fsdp=True, fp32=True, cbs_extra=[W.bf16]),
    ddp_bf16         = dict(sizes=[32,32], ga=dict(n_step=4), fp32=True, cbs_extra=[W.bf16]),
    fsdp_fp16        = dict(sizes=[32,32], ga=dict(n_step=4), fsdp=True, fp32=True, cbs_extra=[W.fp16]),
    ddp_fp16         = dict(sizes=[32,32], ga=dict(n_step=4), fp32=True, cbs_extra=[W.fp16]),
    fsdp_nan         = dict(sizes=[32,32], ga=dict(n_step=4), fsdp=True, nan_at=(1, 5)),
    fsdp_cancel      = dict(sizes=[32,32], ga=dict(n_step=4), fsdp=True, cancel_fit_at=6, n_epoch=1),
    fsdp_micro3      = dict(sizes=[28,32], bs=8, ga=dict(n_step=2, micro_bs=3), fsdp=True),
    fsdp_pool        = dict(sizes=[32,32], ga=dict(n_step=4), bn='pool', shift=1., fsdp=True),
    fsdp_momentum    = dict(sizes=[32,32], ga=dict(n_step=4), bn='momentum', shift=1., fsdp=True),
    fsdp_freeze      = dict(sizes=[32,32], ga=dict(n_step=4), bn='freeze', shift=1., fsdp=True),
    fsdp_groupnorm   = dict(sizes=[32,32], ga=dict(n_step=4), bn='groupnorm', fsdp=True),
    fsdp_auto        = dict(sizes=[32,32], bs=8, ga=dict(micro_bs='auto'), fsdp=True),
    fsdp_root_only_blocks = dict(sizes=[32,32], ga=dict(n_step=4), fsdp=dict(root=False)),
)
HAS_ACCELERATE = importlib.util.find_spec('accelerate') is not None

@pytest.fixture(scope='module')
def runs():
    scen = SCENARIOS if HAS_ACCELERATE else {k:v for k,v in SCENARIOS.items() if not k.startswith('fastai_path')}
    if not HAS_FSDP2: scen = {k:v for k,v in scen.items() if not v.get('fsdp')}
    r0,r1 = launch_gloo(W.run_many, kwargs=dict(scenarios=scen))
    return {k: (r0[k], r1[k]) for k in scen}

def get(runs, name):
    r0,r1 = runs[name]
    for r in (r0, r1): assert 'error' not in r, r['error']
    return r0,r1

def actions(r): return [m['action'] for m in r['micro']]

def check_one_round_per_step(r):
    "Each stepping micro-batch all-reduces every bucket once (one round); the others all-reduce nothing"
    for m in r['micro']:
        if m['action'] == 'step': assert m['rounds'] == 1 and sorted(m['buckets']) == list(range(len(m['buckets']))), m
        else: assert m['rounds'] == 0 and m['buckets'] == [], m
    assert r['rounds'] == r['steps'] == actions(r).count('step')

def check_large_batch(r0, r1, **kw):
    "Both ranks hold the weights plain SGD reaches with one step per window on the union of both ranks' samples"
    assert len(r0['windows']) == len(r1['windows']) == r0['steps']
    ref = W.large_batch_reference([r0['windows'], r1['windows']], **kw)
    assert rel_err(r0['params'], ref) < TOL and rel_err(r1['params'], ref) < TOL

# (a) ------------------------------------------------------------------------------------------------------------------
def test_one_allreduce_per_step(runs):
    r0,r1 = get(runs, 'n_step4')
    assert r0['steps'] == 4 and len(r0['micro']) == 16
    assert r0['n_buckets'] > 1   # the tiny bucket cap: "once per bucket" is a real check
    for r in (r0, r1): check_one_round_per_step(r)

@pytest.mark.parametrize('name', ['sync_every', 'fastai_accum'])
def test_k_allreduces_per_step_without_no_sync(runs, name):
    r0,r1 = get(runs, name)
    ours = get(runs, 'n_step4')[0]
    for r in (r0, r1):
        assert r['rounds'] == len(r['micro']) == 16 == 4*ours['rounds']   # every micro-batch: k=4 rounds per step
        assert all(m['rounds'] == 1 for m in r['micro'])

# (b) ------------------------------------------------------------------------------------------------------------------
def test_weights_equal_sync_every_and_large_batch(runs):
    r0,r1 = get(runs, 'n_step4')
    s0,s1 = get(runs, 'sync_every')
    assert torch.equal(r0['params'], r1['params'])
    assert rel_err(r0['params'], s0['params']) < TOL and rel_err(r1['params'], s1['params']) < TOL
    check_large_batch(r0, r1)
    assert r0['window_items'] == [32.]*4   # 16 samples per rank per window

# (c) ------------------------------------------------------------------------------------------------------------------
def test_uneven_last_batch(runs):
    r0,r1 = get(runs, 'uneven')
    assert [m['bs'] for m in r0['micro'][:4]] == [4,4,4,2] and [m['bs'] for m in r1['micro'][:4]] == [4,4,4,4]
    assert r0['window_items'] == r1['window_items'] == [30., 30.]   # global count, the same on both ranks
    for r in (r0, r1): check_one_round_per_step(r)
    check_large_batch(r0, r1)

def test_uneven_token_counts(runs):
    r0,r1 = get(runs, 'tokens')
    tok = lambda w: w[1][:, 3:].sum().item()   # the mask columns: tokens that count
    t0,t1 = [tok(w) for w in r0['windows']],[tok(w) for w in r1['windows']]
    assert all(b > 2*a for a,b in zip(t0, t1))   # ranks really differ
    assert r0['window_items'] == r1['window_items'] == [a+b for a,b in zip(t0, t1)]
    for r in (r0, r1): check_one_round_per_step(r)
    check_large_batch(r0, r1, tokens=True)   # the global token-weighted mean gradient

# (d) ------------------------------------------------------------------------------------------------------------------
# per epoch of 4 micro-batches (rank 0's last holds 2 samples); `None`: accumulate under no_sync
S,D,_ = 'step','drop',None
@pytest.mark.parametrize('name,acts,dropped,items', [
    # target 8 at bs 4: a window is 2 micro-batches on *every* rank, even where rank 0's short batch leaves it at 6
    ('target8_drop',   [_,S,_,S]*2,         0, [16.,14.]*2),
    ('target12_drop',  [_,_,S,D]*2,         2, [24.]*2),
    ('target12_step',  [_,_,S,S]*2,         0, [24.,6.]*2),
    ('target12_carry', [_,_,S,_, _,S,_,D],  1, [24.,22.]),   # the carried window spans the epochs; the fit's end drops
    ('n_step3_carry',  [_,_,S,_, _,S,_,D],  1, [24.,22.]),
])
def test_windows_decide_sync(runs, name, acts, dropped, items):
    r0,r1 = get(runs, name)
    for r in (r0, r1):
        assert actions(r) == acts and r['n_dropped'] == dropped and r['window_items'] == items
        check_one_round_per_step(r)
    assert torch.equal(r0['params'], r1['params'])
    check_large_batch(r0, r1)

# fastai's own path ---------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not HAS_ACCELERATE, reason="fastai's `distrib_ctx` needs accelerate")
def test_fastai_distrib_ctx(runs):
    "`learn.distrib_ctx()`: Accelerate wraps the model in DDP, `DistributedDL` shards the data (CPU shim for its broadcast)"
    r0,r1 = get(runs, 'fastai_path')
    assert r0['steps'] == 2 and r0['window_items'] == [32., 32.]   # 32 samples shared out: 16 per rank, 4 micro-batches
    for r in (r0, r1): check_one_round_per_step(r)
    assert not any(torch.equal(a[0], b[0]) for a,b in zip(r0['windows'], r1['windows']))   # each rank its own shard
    check_large_batch(r0, r1)

@pytest.mark.skipif(not HAS_ACCELERATE, reason="fastai's `distrib_ctx` needs accelerate")
@pytest.mark.parametrize('name,per_rank,bs,n_step', [('fastai_path_69_4_3', 35, 4, 3), ('fastai_path_60_8_4', 30, 8, 4),
                                                     ('fastai_path_69_micro', 35, 4, 3)])
def test_distrib_ctx_steps_the_epochs_last_window(runs, name, per_rank, bs, n_step):
    """Under `distrib_ctx` with `drop_last=True` each rank steps the windows one process steps over the same shard
    (`per_rank` items, the padded share; loader batches of `bs`, windows of `n_step`): the last one included, whatever
    `len(DistributedDL)` says, and the weights are one large batch's per window over both ranks' samples"""
    r0,r1 = get(runs, name)
    batches = per_rank//bs
    per_epoch = -(-batches//n_step)   # the last window partial, stepped ('step')
    expect = [float(min(n_step, batches - i*n_step)*bs*2) for i in range(per_epoch)]*2   # global items, 2 epochs
    for r in (r0, r1):
        assert r['n_dropped'] == 0 and r['steps'] == 2*per_epoch and r['window_items'] == expect, (r['steps'], r['window_items'])
    assert torch.equal(r0['params'], r1['params'])
    check_large_batch(r0, r1)

# BatchNormAccumulation('pool') with per-rank BatchNorm ----------------------------------------------------------------
# SyncBatchNorm needs CUDA inputs (torch raises on CPU), so only per-rank BatchNorm is tested here.
@pytest.mark.parametrize('name', ['bn_pool', 'bn_pool_uneven'])
def test_bn_pool_per_rank(runs, name):
    """Each rank pools its own window (the statistics one large batch of that rank's samples gives); DDP broadcasts rank
    0's buffers at the first forward of every window, so the running statistics follow rank 0's windows. After the
    last step, rank 1 holds rank 0's statistics updated once with its own last window (until the next synced forward)"""
    r0,r1 = get(runs, name)
    for r in (r0, r1): check_one_round_per_step(r); assert r['bn_stats'][2] == r['steps']   # one update per step
    (m0,v0),(u0,_) = W.bn_pool_reference(r0['windows']),W.bn_pool_reference([(torch.cat([a[0], b[0]]), None)
                                                                           for a,b in zip(r0['windows'], r1['windows'])])
    assert rel_err(r0['bn_stats'][0], m0) < TOL and rel_err(r0['bn_stats'][1], v0) < TOL
    assert rel_err(r0['bn_stats'][0], u0) > 0.1   # not the union's: the ranks' data differ
    m1,v1 = W.bn_pool_reference(r0['windows'][:-1]+r1['windows'][-1:])
    assert rel_err(r1['bn_stats'][0], m1) < TOL and rel_err(r1['bn_stats'][1], v1) < TOL

def test_count_allreduces_needs_ddp():
    with pytest.raises(TypeError, match='DistributedDataParallel'): count_allreduces(torch.nn.Linear(2, 2))

# micro_bs ---------------------------------------------------------------------------------------------------------------
def test_fixed_micro_bs_under_ddp(runs):
    """micro_bs=3 on loader batches of 8 (8 -> 3,3,2; rank 0's last batch of 4 -> 2,1,1: as many micro-batches on
    every rank), n_step 2: one all-reduce round per step, the large batch's weights"""
    r0,r1 = get(runs, 'micro3')
    check_one_round_per_step(r0); check_one_round_per_step(r1)
    assert len(r0['micro']) == len(r1['micro']) == 24 and r0['micro_bs'] == r1['micro_bs'] == 3
    assert [m['bs'] for m in r0['micro'][-3:]] == [2, 1, 1] and [m['bs'] for m in r1['micro'][-3:]] == [3, 3, 2]
    check_large_batch(r0, r1)

def test_auto_oom_on_one_rank_all_ranks_agree(runs):
    """micro_bs='auto', out of memory above 3 items on rank 1 only: the ranks agree after each micro-batch, so rank 0
    undoes its own (fitting) micro-batch too and both retry at 4, then 2, in step: no deadlock (fastai gathers every
    micro-batch's loss), no rank stepping alone, both at micro_bs 2, both holding the large batch's weights"""
    r0,r1 = get(runs, 'auto_oom_rank1')
    assert r0['micro_bs'] == r1['micro_bs'] == 2 and r0['steps'] == r1['steps'] == 8
    assert [m['bs'] for m in r0['micro']] == [m['bs'] for m in r1['micro']] == [2]*32   # the undone attempts log nothing
    check_large_batch(r0, r1)

# issue 20 ---------------------------------------------------------------------------------------------------------------
def test_auto_one_rank_cancel_agrees_and_carries_on(runs):
    """micro_bs='auto': rank 1's callback cancels its 3rd micro-batch before the backward. Rank 0 undoes the same
    micro-batch and cancels it too (no rank waits in a collective; before, rank 0 waited for ever): both ranks end with
    the same weights, which are one large batch per step of the samples both kept"""
    r0,r1 = get(runs, 'auto_cancel_rank1')
    assert torch.equal(r0['params'], r1['params'])
    assert r0['steps'] == r1['steps'] == 4
    kept = [len(w[0]) for w in r0['windows']]
    assert kept == [16, 8, 16, 16] == [len(w[0]) for w in r1['windows']]   # the cancelled micro-batch is out of both
    check_large_batch(r0, r1)

def test_auto_cancel_on_one_rank_and_oom_on_the_other(runs):
    "The same micro-batch cancelled on rank 1 and out of memory on rank 0: both retry it smaller, in step"
    r0,r1 = get(runs, 'auto_cancel_oom')
    assert r0['micro_bs'] == r1['micro_bs'] == 4 and torch.equal(r0['params'], r1['params'])
    check_large_batch(r0, r1)

def test_check_accumulation_on_each_rank(runs):
    for name,causes in (('check_ddp', ()), ('check_ddp_bn', ('batchnorm',))):
        for r in get(runs, name):
            assert r['check']['sizes'] == [4]*4 and r['check']['causes'] == causes and r['check']['exact'] == (not causes)

# issue 22: FSDP2 ------------------------------------------------------------------------------------------------------
@needs_fsdp2
def test_fsdp_one_reduce_scatter_round_per_window(runs):
    """Micro-batches that do not step skip FSDP2's reduce-scatter; the one that steps reduce-scatters every group once.
    `sharded_grads=True` reduce-scatters every micro-batch instead (k rounds); `gathered_params=True` all-gathers once
    a window instead of twice a micro-batch (the Learner's `FSDPOptions`).
    Every mode: the same weights, one large batch per step"""
    r0,r1 = get(runs, 'fsdp_n4')
    c = r0['collectives']
    assert c['groups'] == 2 and r0['steps'] == 4 and len(r0['micro']) == 16
    assert c['rs'] == c['groups']*r0['steps'] and c['ag'] == 2*c['groups']*16   # 1 round a window; gathers: fwd + bwd
    assert [m['rounds'] for m in r0['micro']] == [0, 0, 0, 1]*4
    s0,_ = get(runs, 'fsdp_sharded')
    assert s0['collectives']['rs'] == c['groups']*16 and all(m['rounds'] == 1 for m in s0['micro'])   # k rounds
    g0,_ = get(runs, 'fsdp_gathered')
    assert g0['collectives']['ag'] == c['groups']*g0['steps'] and g0['collectives']['rs'] == c['rs']
    for name in ('fsdp_n4', 'fsdp_sharded', 'fsdp_gathered'):
        a,b = get(runs, name)
        assert torch.equal(a['params'], b['params']); check_large_batch(a, b)

@needs_fsdp2
@pytest.mark.parametrize('name,items', [('fsdp_uneven', [30., 30.]), ('fsdp_tokens', None), ('fsdp_t12_drop', [24.]*2),
                                        ('fsdp_t12_carry', [24., 22.]), ('fsdp_n3_step', [24., 6.]*2)])
def test_fsdp_global_item_weighted_mean(runs, name, items):
    """Uneven item counts across ranks (a short last batch; token counts), partial windows, target_bs: every step is one
    large batch of the union of both ranks' window samples (before: 110% off, each rank divided by its own count after
    FSDP had averaged over the ranks)"""
    r0,r1 = get(runs, name)
    assert r0['window_items'] == r1['window_items'] and (items is None or r0['window_items'] == items)
    check_large_batch(r0, r1, tokens=name == 'fsdp_tokens')

@needs_fsdp2
@pytest.mark.parametrize('fsdp,ddp,tol', [('fsdp_clip', 'ddp_clip', 1e-12), ('fsdp_bf16', 'ddp_bf16', 1e-6),
                                          ('fsdp_fp16', 'ddp_fp16', 1e-6)])
def test_fsdp_clipping_and_mixed_precision_as_under_ddp(runs, fsdp, ddp, tol):
    """GradientClip over DTensor gradients, fastai's MixedPrecision in bf16 and in fp16 with its grad scaler (unscaled once a
    window, on the CPU's autocast here): the weights DDP reaches, which are exact there"""
    for a,b in zip(get(runs, fsdp), get(runs, ddp)): assert rel_err(a['params'], b['params']) <= tol

@needs_fsdp2
def test_fsdp_nonfinite_window_skipped_on_every_rank(runs):
    r0,r1 = get(runs, 'fsdp_nan')
    assert r0['n_skipped'] == r1['n_skipped'] == 2 and r0['steps'] == 2   # rank 1's NaN sample: both ranks skip
    check_large_batch(r0, r1)

@needs_fsdp2
def test_fsdp_fit_cancelled_mid_window_leaves_nothing(runs):
    "A fit cancelled in the middle of a window holds no unsharded gradient after it; the next fit is exact"
    r0,r1 = get(runs, 'fsdp_cancel')
    assert r0['held_after_cancel'] == r1['held_after_cancel'] == 0
    assert len(r0['windows']) == len(r1['windows']) == 1 + r0['steps'] == 3   # one step before the cancel, two after
    ref = W.large_batch_reference([r0['windows'], r1['windows']])
    assert rel_err(r0['params'], ref) < TOL and rel_err(r1['params'], ref) < TOL

@needs_fsdp2
def test_fsdp_fixed_micro_bs(runs):
    r0,r1 = get(runs, 'fsdp_micro3')
    assert r0['collectives']['rs'] == r0['collectives']['groups']*r0['steps']
    check_large_batch(r0, r1)

@needs_fsdp2
def test_fsdp_batchnorm_modes(runs):
    """'pool' on each rank's own buffers (FSDP2 shards parameters, not buffers, and broadcasts none): each rank's running
    statistics are those one large batch of its own windows leaves; 'momentum'/'freeze' train alike on both ranks"""
    r0,r1 = get(runs, 'fsdp_pool')
    for r in (r0, r1):
        rm,rv = W.bn_pool_reference(r['windows'])
        assert rel_err(r['bn_stats'][0], rm) < TOL and rel_err(r['bn_stats'][1], rv) < TOL and r['bn_stats'][2] == r['steps']
    assert rel_err(r0['bn_stats'][0], r1['bn_stats'][0]) > 0.1   # the ranks' data differ
    for name in ('fsdp_momentum', 'fsdp_freeze'):
        a,b = get(runs, name); assert torch.equal(a['params'], b['params']) and a['steps'] == 4

@needs_fsdp2
@pytest.mark.parametrize('name,match', [('fsdp_groupnorm', 'Convert before sharding'), ('fsdp_auto', r"MicroBatching\('auto'\) under FSDP2"),
                                        ('fsdp_root_only_blocks', 'not its root')])
def test_fsdp_refusals_say_what_to_do(runs, name, match):
    import re
    r0,r1 = runs[name]
    for r in (r0, r1): assert 'error' in r and re.search(match, r['error']), r.get('error', '')[:300]

@needs_fsdp2
def test_fsdp_save_load_whole_model(tmp_path):
    """`learn.save` writes the whole model (gathered, rank 0 writes) and the optimizer state; `learn.load` into another
    sharded Learner gives every rank its own shard of it (before: rank 0's shard on every rank, weights 0.74 off). The
    file is read without running code: a planted one is refused on every rank, and what it holds never runs"""
    r0,r1 = launch_gloo(W.fsdp_save_load, kwargs=dict(d=str(tmp_path)))
    for r in (r0, r1): assert torch.equal(r['a'], r['b']) and r['opt_equal'] and r['planted'] == ('refused', False), r['planted']
    assert r0['file_shapes'] == r0['full_shapes']

@needs_fsdp2
def test_fsdp_way_in_equals_ddp_and_exports(tmp_path):
    """`learn.fsdp_ctx()` (to_fsdp: FSDP2 block by block, optimizer rebuilt, DistributedDL; from_fsdp after) trains
    exactly what fastai's `distrib_ctx` (Accelerate's DDP) does, and `learn.export` under it writes an unsharded model
    that `load_learner` predicts with in one process"""
    f0,f1 = launch_gloo(W.fsdp_way_in, kwargs=dict(d=str(tmp_path)))
    d0,_ = launch_gloo(W.fsdp_way_in, kwargs=dict(d=str(tmp_path/'ddp'), path='ddp'))
    assert f0['sharded'] == 'FSDPMLP' and f0['plain'] == 'MLP' and f0['steps'] == d0['steps'] == 8
    assert rel_err(f0['params'], d0['params']) < TOL and torch.equal(f0['params'], f1['params'])
    import warnings
    from fastai.learner import load_learner
    with warnings.catch_warnings():
        warnings.simplefilter('ignore'); learn = load_learner(tmp_path/'exported.pkl')
    assert type(learn.model).__name__ == 'MLP'
    m = W.MLP(n_in=5, n_out=3).double()
    torch.nn.utils.vector_to_parameters(f0['params'], m.parameters())
    x = torch.randn(3, 5, dtype=torch.float64)
    assert torch.allclose(learn.model(x), m(x))

def test_fsdp1_is_refused_pointing_to_to_fsdp():
    """A model in FSDP1's `FullyShardedDataParallel` (what Accelerate's FSDP plugin makes through fastai's `distrib_ctx`)
    is refused when training starts, pointing to `learn.to_fsdp()`. FSDP1 needs a GPU to be built, so the wrapper here is
    an FSDP1 instance made without its constructor: the check is by type"""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    from helpers import MLP
    fake = FSDP1.__new__(FSDP1); torch.nn.Module.__init__(fake); fake._modules['_fsdp_wrapped_module'] = MLP()
    from accum_callback.core.distributed import check_fsdp
    with pytest.raises(ValueError, match=r'FSDP1.*learn\.to_fsdp\(\)'): check_fsdp(torch.nn.Sequential(fake))
    check_fsdp(MLP())   # an unsharded model passes (`GradientAccumulation` calls this at before_fit and before_train)

@pytest.mark.skipif(not HAS_ACCELERATE, reason='fastai.distributed needs accelerate')
def test_micro_bs_under_fastai_distrib_ctx(runs):
    """`micro_bs` under fastai's `distrib_ctx`: its DistributedTrainer wraps `learn.dl` in `DistributedDL` in its own
    `before_train` (order 11); the micro-batches used to be wrapped again and never cut (4 batches of 4, no step). They
    are cut after it now: micro-batches of 2, the same steps and weights as loader batches of 4 uncut"""
    a0,a1 = get(runs, 'fastai_path_n2')
    b0,b1 = get(runs, 'fastai_path_micro2')
    assert {m['bs'] for m in b0['micro']} == {2} and len(b0['micro']) == 2*len(a0['micro'])
    assert b0['steps'] == a0['steps'] == 4
    for a,b in ((a0, b0), (a1, b1)): assert rel_err(b['params'], a['params']) < TOL

@needs_fsdp2
def test_fsdp_error_on_one_rank_is_the_error_the_user_sees():
    """Issue 43: a rank that raises inside `learn.fsdp_ctx()` used to gather the weights on its way out (a collective)
    while the other rank was still training: the healthy rank aborted (SIGABRT, no traceback) and the real error was
    never shown. Now the failed rank raises its own error at once, and that error is what the launch reports"""
    import time
    t = time.perf_counter()
    with pytest.raises(RuntimeError, match=r'rank 1 of 2 failed') as e:
        launch_gloo(W.fsdp_raise_on_one_rank, timeout=20)
    msg = str(e.value)
    # the traceback ends with the original error, not with a collective's (before: "Connection reset by peer" after a
    # gather, the other rank aborted by gloo's EnforceNotMet)
    assert re.search(r'ValueError: [^\n]*\n\s*boom on rank 1\s*$', msg), msg[-600:]
    assert 'another exception occurred' not in msg and 'from_fsdp' not in msg, msg[-600:]
    assert time.perf_counter() - t < 60
