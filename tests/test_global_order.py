"""`GradientAccumulation(target_bs=..., global_window=True)` (issue 54, its first part): the same large-batch run on any
number of processes. fastai's `DistributedDL` gives each rank a contiguous part of the epoch's order, so 2 ranks x 2
micro-batches held other samples than 1 rank x 4: the runs on 1 and 2 processes ended apart. With `global_window` each
window of `target_bs` samples is the same on 1, 2 and 4 gloo processes (listed and compared window by window), and the
weights after `fit_one_cycle` (shuffled, float64) equal the 1-process run's to 1e-6 relative. A run stopped on one
number of processes and resumed on another is the same run too (`accum_callback.elastic`)."""
import pytest
import torch

from accum_callback import GradientAccumulation
from accum_callback.global_order import window_share
from accum_callback.testing import launch_gloo
from helpers import needs_fsdp2, rel_err
import elastic_worker as W

TOL = 1e-6

def test_window_share_gives_each_rank_its_part_of_each_window():
    idxs = list(range(20, 0, -1))
    assert window_share(idxs, 8, 2, 0) == [20, 19, 18, 17, 12, 11, 10, 9, 4, 3] and window_share(idxs, 8, 2, 1) == [16, 15, 14, 13, 8, 7, 6, 5, 2, 1]
    # the ranks' shares, window by window, are the global order less its partial last window (4 of 20 here)
    for world in (1, 2, 4):
        shares = [window_share(idxs, 8, world, r, partial=False) for r in range(world)]
        per = 8//world
        got = [i for k in range(2) for s in shares for i in s[k*per:(k+1)*per]]
        assert got == idxs[:16]
        # and the partial last window shared as evenly as can be, rank by rank in order
        whole = [window_share(idxs, 8, world, r) for r in range(world)]
        assert [i for s in whole for i in s[2*per:]] == idxs[16:] and max(map(len, whole)) - min(map(len, whole)) <= 1

# -- in this process: the arithmetic the runs on several processes rest on ---------------------------------------------
from hypothesis import given, settings, strategies as st

@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 300), window=st.sampled_from([8, 12, 16, 24, 32]), world=st.integers(1, 4), bs=st.sampled_from([1, 2, 4]),
       partial=st.sampled_from(['step', 'drop']), drop_last=st.booleans())
def test_ranks_shares_are_the_one_process_order_window_by_window(n, window, world, bs, partial, drop_last):
    """Where `share_problem` lets `world` ranks share the windows, the ranks' shares hold each window's samples of the
    one-process order (whole windows: `window/world` each), no sample twice, and `rank_batches` counts each rank's batches"""
    from accum_callback.global_order import rank_batches, share_problem
    if share_problem(window, world, bs, n, partial, drop_last) is not None: return
    idxs = list(range(n, 0, -1))
    unit = bs if drop_last else 1
    shares = [window_share(idxs, window, world, r, partial != 'drop', unit) for r in range(world)]
    kept = idxs[:n//unit*unit]
    whole = len(kept)//window*window
    per = window//world
    for j in range(whole//window):   # window j: the ranks' parts, rank by rank, are its samples in order
        assert sum((s[j*per:(j+1)*per] for s in shares), []) == kept[j*window:(j+1)*window]
    rest = sorted(i for s in shares for i in s[whole//window*per:])
    assert rest == (sorted(kept[whole:]) if partial != 'drop' else [])
    for r,s in enumerate(shares):
        assert rank_batches(n, window, world, r, bs, partial != 'drop', drop_last) == -(-len(s)//bs)

@settings(max_examples=200, deadline=None)
@given(j=st.integers(0, 5), window=st.sampled_from([8, 16, 24, 48]), old=st.integers(1, 4), new=st.integers(1, 4), bs=st.sampled_from([1, 2, 4]))
def test_a_place_at_a_windows_end_is_the_same_samples_on_another_number_of_processes(j, window, old, new, bs):
    """`elastic.batches_in_world`: after `j` whole windows, the batches each rank of `old` had read and those each rank of
    `new` reads up to the place counted again cover the same samples of the order, the first `j` windows"""
    from accum_callback.elastic import batches_in_world
    if window % (old*bs) or window % (new*bs): return
    n = (j + 2)*window
    idxs = list(range(n))
    k_old = j*window//(old*bs)
    k_new = batches_in_world(k_old, window, old, new, bs)
    read = lambda world, k: sorted(i for r in range(world) for i in window_share(idxs, window, world, r)[:k*bs])
    assert read(old, k_old) == read(new, k_new) == idxs[:j*window]

def _global(per_rank):
    "Each step's window over all ranks, rank by rank"
    assert len({len(w) for w in per_rank}) == 1   # every rank steps as often
    return [sum((r[k] for r in per_rank), []) for k in range(len(per_rank[0]))]

@pytest.fixture(scope='module')
def one():
    return W.train(world=1)

@pytest.mark.parametrize('world', [2, 4])
def test_the_same_windows_and_weights_on_any_number_of_processes(one, world):
    """96 samples, micro-batches of 4, windows of 32 samples, two epochs of `fit_one_cycle`: 6 steps, each on the same
    32 samples cut into the same micro-batches whatever the number of processes; the weights equal to 1e-6"""
    rs = launch_gloo(W.train, world=world, timeout=120)
    assert one['steps'] == 6 and all(r['steps'] == 6 for r in rs)
    assert _global([r['windows'] for r in rs]) == one['windows']
    for r in rs: assert rel_err(r['params'], one['params']) <= TOL
    # fastai's own sharding, without global_window: other windows, other weights (what this fixes)
    if world == 2:
        plain = launch_gloo(W.train, world=2, kwargs=dict(window=16, global_window=False), timeout=120)
        assert _global([r['windows'] for r in plain]) != one['windows']
        assert rel_err(plain[0]['params'], one['params']) > 1e-3

@pytest.mark.parametrize('world', [2, 4])
def test_pool_running_statistics_are_one_processs_on_any_number(world):
    """`BatchNormAccumulation('pool')` in a `global_window` run pools each window over all ranks' micro-batches: every
    rank's running statistics equal the 1-process run's to 1e-6 (per rank they were 3.7e-2 apart on 2 processes)"""
    one = W.train(layer='batchnorm', bn='pool')
    rs = launch_gloo(W.train, world=world, kwargs=dict(layer='batchnorm', bn='pool'), timeout=180)
    for r in rs: assert rel_err(r['params'], one['params']) <= TOL and rel_err(r['buffers'], one['buffers']) <= TOL

def test_precise_leaves_the_training_order_alone_on_any_number_of_processes(one):
    """Issue 63 item 4: `BatchNormAccumulation('pool', precise=40)`'s recomputation read a copy of fastai's `DistributedDL`
    that shared the loader it wraps, and drew from its RNG: epoch 2's order on 2 processes was not one process's"""
    ref = W.train(world=1, layer='batchnorm', bn='pool', precise=40)
    rs = launch_gloo(W.train, world=2, kwargs=dict(layer='batchnorm', bn='pool', precise=40), timeout=180)
    assert _global([r['windows'] for r in rs]) == ref['windows']
    assert rel_err(rs[0]['params'], ref['params']) <= TOL

@pytest.mark.parametrize('partial,steps', [('step', 8), ('drop', 6)])
def test_a_partial_last_window_is_stepped_or_dropped_alike(partial, steps):
    """100 samples in windows of 32 leave 4 an epoch: shared by the ranks (2 each, one micro-batch) and stepped as one
    process steps it, or dropped by every number of processes"""
    one = W.train(world=1, n=100, partial=partial)
    rs = launch_gloo(W.train, world=2, kwargs=dict(n=100, partial=partial), timeout=120)
    assert _global([r['windows'] for r in rs]) == one['windows'] and one['steps'] == steps
    assert rel_err(rs[0]['params'], one['params']) <= TOL

@pytest.mark.parametrize('n,partial,steps', [(106, 'step', 8), (102, 'drop', 6)])
def test_with_fastai_drop_last_the_same_windows_and_steps(n, partial, steps):
    """fastai's default for a shuffled training loader, `drop_last=True`: one process drops an incomplete last
    micro-batch; the ranks drop the same samples and share the rest of the last window in whole micro-batches (106: 2
    dropped, 8 left, one micro-batch each), or all drop it. Before, each rank dropped its own short micro-batch (106: 10
    left, 5 a rank, one of each dropped: other samples); 100 samples gave 6 steps on 2 processes against 8 on one"""
    one = W.train(world=1, n=n, partial=partial, drop_last=True)
    rs = launch_gloo(W.train, world=2, kwargs=dict(n=n, partial=partial, drop_last=True), timeout=120)
    assert _global([r['windows'] for r in rs]) == one['windows'] and one['steps'] == steps
    assert rel_err(rs[0]['params'], one['params']) <= TOL

def test_with_fastai_drop_last_a_last_window_the_ranks_cannot_share_is_refused():
    "108 samples: 12 left after the windows, 3 micro-batches of 4, which 2 ranks cannot share alike"
    with pytest.raises(RuntimeError, match=r"108 samples leave a last window of 12.*partial='drop'"):
        launch_gloo(W.train, world=2, kwargs=dict(n=108, drop_last=True), timeout=120)

@pytest.mark.parametrize('n', [97, 105])
def test_a_partial_last_window_the_ranks_cannot_share_is_refused(n):
    "1 sample left (a rank would have none), or 9 in micro-batches of 4 (5 and 4: two micro-batches on one rank, one on the other)"
    with pytest.raises(RuntimeError, match=rf"{n} samples leave a last window of {n % 32}.*partial='drop'"):
        launch_gloo(W.train, world=2, kwargs=dict(n=n), timeout=120)

def test_a_window_the_ranks_cannot_share_is_refused_naming_the_numbers():
    with pytest.raises(RuntimeError, match=r"target_bs=24.*3 micro-batches a rank|target_bs=24.*divides"):
        launch_gloo(W.train, world=4, kwargs=dict(window=24), timeout=120)

def test_a_loader_fastai_did_not_shard_is_refused_at_fit_start():
    "DDP by hand over fastai's plain loader: each rank would read the whole data; refused before anything is set up, naming the way in"
    with pytest.raises(RuntimeError, match=r"global_window=True\) on several processes reads the training loader through fastai's `DistributedDL`"):
        launch_gloo(W.train, world=2, kwargs=dict(by_hand=True), timeout=120)

def test_global_window_needs_a_number_of_samples():
    for kw in (dict(n_step=2), dict(target_bs={0: 8}), dict(n_acc=32), dict(target_bs=32, micro_bs=2)):
        with pytest.raises(ValueError, match='global_window=True'): GradientAccumulation(global_window=True, **kw)

def test_global_window_refuses_a_carried_window_at_construction():
    "Issue 63 item 3: `partial='carry'` restarted its grid each epoch on several processes (weights 5.8e-3 apart): refused, naming the way"
    with pytest.raises(ValueError, match=r"partial='carry'.*give partial='step' \(the default\) or 'drop'"):
        GradientAccumulation(target_bs=32, global_window=True, partial='carry')
    for p in ('step', 'drop'): GradientAccumulation(target_bs=32, global_window=True, partial=p)

# -- resumed on another number of processes ----------------------------------------------------------------------------
def _run(world, **kw):
    return W.train(**kw) if world == 1 else launch_gloo(W.train, world=world, kwargs=kw, timeout=180)

def _per_rank(world, res): return [res] if world == 1 else res

@pytest.mark.parametrize('old,new', [(2, 1), (2, 4), (4, 2)])
def test_resumed_on_another_number_of_processes_is_the_same_run(tmp_path, one, old, new):
    """Cut mid-window in the second epoch of `fit_one_cycle` on `old` processes (the checkpoint every window: the one
    before the cut is at a window's end), resumed on `new`: the windows before the cut and after the resume are the
    uninterrupted run's, sample for sample, and the weights equal the uninterrupted 1-process run's to 1e-6"""
    k = 32//(old*4)   # micro-batches a window on `old` processes; 3 windows an epoch
    ck = (str(tmp_path/'ck'), dict(every=1))
    cut = _per_rank(old, _run(old, ckpt=ck, cut=4*k + 1))   # the first micro-batch of the epoch's second window
    assert all(r['cut'] for r in cut)
    before = _global([r['windows'] for r in cut])
    assert before == one['windows'][:4]
    res = _per_rank(new, _run(new, ckpt=ck))
    assert all(r['resumed'].endswith('.rank0.pt') for r in res)
    after = _global([r['windows'] for r in res])
    assert before + after == one['windows']
    for r in res: assert rel_err(r['params'], one['params']) <= TOL and r['said'] == []   # (nothing here differs: nothing said)

@pytest.mark.parametrize('layer,bn,says', [('dropout', None, 'training draws random numbers'),
                                           ('batchnorm', None, 'update their running statistics'),
                                           ('batchnorm', 'momentum', 'update their running statistics'),
                                           ('batchnorm', 'pool', None), ('batchnorm', 'freeze', None), ('batchnorm', 'groupnorm', None)])
def test_what_another_number_of_processes_changes_is_said_at_resume(tmp_path, layer, bn, says):
    """Cut on 2 processes, resumed on 1: dropout (each rank draws its own masks) and BatchNorm's running statistics (each
    rank keeps its own: plain, 'momentum') are said in one line each; 'pool' (pooled over all ranks' part of each
    window), 'freeze' and 'groupnorm' say nothing and stay the uninterrupted 1-process run, weights and running
    statistics to 1e-6; with dropout the weights are apart, as said"""
    ck = (str(tmp_path/'ck'), dict(every=1))
    kw = dict(layer=layer, bn=bn)
    _run(2, ckpt=ck, cut=17, **kw)   # the first micro-batch of the second epoch's second window
    res,one = W.train(ckpt=ck, **kw),W.train(**kw)
    assert res['said'] == [] if says is None else (len(res['said']) == 1 and says in res['said'][0])
    if says is None: assert rel_err(res['params'], one['params']) <= TOL and rel_err(res['buffers'], one['buffers']) <= TOL
    elif layer == 'dropout': assert rel_err(res['params'], one['params']) > 1e-3
    else: assert rel_err(res['params'], one['params']) <= TOL and rel_err(res['buffers'], one['buffers']) > 1e-3

def test_a_checkpoint_mid_window_is_refused_on_another_number_of_processes(tmp_path):
    "Saved after every micro-batch (`batches=1`), cut mid-window on 2 processes: on 1 the half window is refused, naming both numbers; on 2 it resumes"
    ck = (str(tmp_path/'ck'), dict(batches=1))
    _run(2, ckpt=ck, cut=6)   # the second micro-batch of the second window
    from accum_callback.checkpoint import CheckpointError
    with pytest.raises(CheckpointError, match=r"saved on 2 process\(es\) and this run has 1, and it holds half a window"):
        W.train(ckpt=ck)
    res = _run(2, ckpt=ck)
    one = W.train()
    assert rel_err(res[0]['params'], one['params']) <= TOL and res[1]['resumed'].endswith('.rank1.pt')

@pytest.mark.parametrize('world', [2, 4])
def test_the_noise_scale_is_one_processs_on_any_number(world):
    """Issue 63: with `global_window` the small-batch norm is rank 0's first micro-batch, one process's first micro-batch
    of each window, so every estimate is the 1-process run's (float64, 1e-9); it was the ranks' average, another number"""
    one,many = W.train(noise=True),launch_gloo(W.train, world=world, kwargs=dict(noise=True), timeout=180)
    for r in many:
        for k in ('g_small2', 'g_big2', 'b', 'B'):
            a,b = torch.tensor(r['noise'][k]),torch.tensor(one['noise'][k])
            assert a.shape == b.shape and len(b) > 0 and rel_err(a, b) <= 1e-9, (k, a, b)

def test_a_rank_file_missing_from_the_newest_is_passed_over_on_as_many_processes(tmp_path):
    """Issue 61: a `global_window` run cut between the ranks' writes (rank 1's newest file missing), resumed on as many
    processes: that checkpoint is passed over (FileNotFoundError before), the one before it resumed, the same run"""
    ck = (str(tmp_path/'ck'), dict(every=1))
    _run(2, ckpt=ck, cut=17)
    files = sorted((tmp_path/'ck').glob('ckpt-*.rank1.pt'))
    newest = files[-1]; newest.unlink()
    res,one = _run(2, ckpt=ck),W.train()
    assert res[0]['resumed'] == str(files[-2]).replace('.rank1.', '.rank0.') and res[1]['resumed'] == str(files[-2])
    for r in res: assert rel_err(r['params'], one['params']) <= TOL

@needs_fsdp2
def test_fsdp2_runs_the_same_windows_and_weights(one):
    "Under FSDP2 (`learn.fsdp_ctx()`) `global_window` gives the same windows and weights as one process"
    sharded = launch_gloo(W.train, world=2, kwargs=dict(fsdp=True), timeout=180)
    assert _global([r['windows'] for r in sharded]) == one['windows']
    assert rel_err(sharded[0]['params'], one['params']) <= TOL

@pytest.fixture(scope='module')
def one_adam():
    return W.train(world=1, adam=True)

def _run_fsdp(world, **kw): return W.train(**kw) if world == 1 else launch_gloo(W.train, world=world, kwargs=dict(kw, fsdp=True), timeout=180)

@needs_fsdp2
@pytest.mark.parametrize('old,new', [(2, 1), (2, 4), (4, 2), (2, 2)])
def test_fsdp2_resumed_on_another_number_of_processes_is_the_same_run(tmp_path, one_adam, old, new):
    """FSDP2 with Adam (its moments sharded like the weights): cut mid-window in the second epoch of `fit_one_cycle`,
    the checkpoint before the cut at a window's end holds the model and the optimizer in a DCP folder
    (`sharded_checkpoint`), read on `new` processes in their own layout (on 1: whole tensors, no process group); the
    windows before and after are the uninterrupted 1-process run's, sample for sample, the weights equal to 1e-6"""
    k = 32//(old*4)
    ck = (str(tmp_path/'ck'), dict(every=1))
    cut = _per_rank(old, _run_fsdp(old, ckpt=ck, cut=4*k + 1, adam=True))
    assert all(r['cut'] for r in cut) and sorted(p.name for p in (tmp_path/'ck').glob('*.dcp')) == ['ckpt-000003.dcp', 'ckpt-000004.dcp']
    before = _global([r['windows'] for r in cut])
    assert before == one_adam['windows'][:4]
    res = _per_rank(new, _run_fsdp(new, ckpt=ck, adam=True))
    assert all(r['resumed'].endswith('ckpt-000004.rank0.pt' if new != old else f'ckpt-000004.rank{i}.pt') for i,r in enumerate(res))
    assert before + _global([r['windows'] for r in res]) == one_adam['windows']
    for r in res: assert rel_err(r['params'], one_adam['params']) <= TOL

@needs_fsdp2
def test_a_whole_checkpoint_is_refused_under_fsdp2_and_a_damaged_dcp_folder_passed_over(tmp_path, one_adam):
    """A DDP run's checkpoint (whole tensors) resumed under FSDP2 is refused naming the way; a DCP folder whose shard is
    damaged is passed over for the checkpoint before it, and the run is still the same"""
    ck = (str(tmp_path/'ddp'), dict(every=1))
    launch_gloo(W.train, world=2, kwargs=dict(ckpt=ck, cut=9, adam=True), timeout=180)
    with pytest.raises(RuntimeError, match=r"CheckpointError.*\n?.*holds whole tensors .* under FSDP2: resume it on 2 process\(es\) under DDP"):
        launch_gloo(W.train, world=2, kwargs=dict(ckpt=ck, fsdp=True, adam=True), timeout=180)
    ck = (str(tmp_path/'fsdp'), dict(every=1))
    launch_gloo(W.train, world=2, kwargs=dict(ckpt=ck, cut=9, fsdp=True, adam=True), timeout=180)
    assert sorted(p.name for p in (tmp_path/'fsdp').glob('*.dcp')) == ['ckpt-000001.dcp', 'ckpt-000002.dcp']
    f = tmp_path/'fsdp'/'ckpt-000002.dcp'/'__1_0.distcp'
    data = bytearray(f.read_bytes()); data[len(data)//2] ^= 0xFF; f.write_bytes(bytes(data))
    res = W.train(ckpt=ck, adam=True)
    assert res['resumed'].endswith('ckpt-000001.rank0.pt') and rel_err(res['params'], one_adam['params']) <= TOL

def test_dcp_metadata_is_read_without_running_code(tmp_path):
    """DCP's metadata file is a pickle: `read_dcp_metadata` makes DCP's metadata classes only. A planted one is refused
    and what it holds never runs; one that declares a non-tensor item (which DCP would unpickle) is refused too"""
    import os, pickle
    import torch.distributed.checkpoint as dcp
    from accum_callback.checkpoint import UnsafeCheckpoint
    from accum_callback.sharded_checkpoint import read_dcp_metadata
    dcp.save({'w': torch.arange(6.).reshape(2, 3)}, checkpoint_id=str(tmp_path/'ok'))
    md = read_dcp_metadata(tmp_path/'ok'/'.metadata')
    assert list(md.state_dict_metadata) == ['w']
    marker = tmp_path/'ran'
    class Planted:
        def __reduce__(self): return (os.system, (f'touch {marker}',))
    (tmp_path/'planted').mkdir(); (tmp_path/'planted'/'.metadata').write_bytes(pickle.dumps(Planted()))
    with pytest.raises(UnsafeCheckpoint, match=r'names (posix|os)\.system'): read_dcp_metadata(tmp_path/'planted'/'.metadata')
    assert not marker.exists()
    dcp.save({'w': torch.zeros(2), 'note': 'bytes'}, checkpoint_id=str(tmp_path/'bytes'))
    with pytest.raises(UnsafeCheckpoint, match="declares 'note' as other than a tensor"): read_dcp_metadata(tmp_path/'bytes'/'.metadata')
