"""Huge pages (huge_pages.py): large host tensors on 2 MiB pages, the KV cache of an
explicit size on them, and the weight panels gathered into one map after loading; a GGUF file's
blocks on them (mapped_blocks.py: in place, gathered, or moved under their addresses); with the
model's outputs unchanged."""
from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from pagedlm import LLM, SamplingParams, huge_pages, mapped_blocks
from tests.conftest import make_tiny_model, needs_kernels
from tests.core.test_kv_cache_memory import caches

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="huge pages and /proc/self/smaps are Linux's")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    return make_tiny_model(tmp_path_factory.mktemp("huge"), "llama", default_model_dir)


def thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "absent"


def map_fields(t: torch.Tensor) -> dict[str, int]:
    """The byte counts /proc/self/smaps gives the mapping that holds t (Rss, AnonHugePages...),
    and its first address (map_start)."""
    addr, inside, fields = t.data_ptr(), False, {}
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split()[0]
            if "-" in first and ":" not in first:
                if inside:
                    break
                lo, hi = (int(x, 16) for x in first.split("-"))
                inside = lo <= addr < hi
                if inside:
                    fields["map_start"] = lo
            elif inside and line.split()[-1] == "kB":
                fields[first.rstrip(":")] = int(line.split()[1]) * 1024
    return fields


def huge_bytes(t: torch.Tensor) -> int:
    """AnonHugePages, or FilePmdMapped for a file's map, of the mapping that holds t."""
    fields = map_fields(t)
    return fields.get("AnonHugePages", 0) or fields.get("FilePmdMapped", 0)


def test_arena_carves_small_tensors_from_shared_maps_that_gather_panels_leaves():
    """Small tensors come one after another, each on a cache line, out of one map until it is
    full, then out of the next; a large one gets a map of its own; gather_panels moves the
    small panels outside an arena and leaves those inside where they are."""
    if not huge_pages.supported():
        pytest.skip("no huge pages here: the arena is torch's own allocations")
    arena = huge_pages.Arena(chunk_bytes=huge_pages.MIN_BYTES)
    small = [arena.empty((1000, 3), torch.bfloat16) for _ in range(3)]  # 6000 B each
    starts = [t.data_ptr() for t in small]
    assert all(b - a == huge_pages.aligned_bytes(6000) for a, b in zip(starts, starts[1:]))
    assert len({t.untyped_storage().data_ptr() for t in small}) == 1
    for i, t in enumerate(small):
        t.fill_(i)
    assert [int(t.float().mean()) for t in small] == [0, 1, 2]  # no overlap
    big = arena.empty((huge_pages.MIN_BYTES // 2,), torch.bfloat16)
    assert big.untyped_storage().data_ptr() != small[0].untyped_storage().data_ptr()
    rest = huge_pages.MIN_BYTES - 3 * huge_pages.aligned_bytes(6000)
    after = arena.empty((rest // 2 + 32,), torch.bfloat16)  # does not fit: a new map
    assert after.untyped_storage().data_ptr() not in (
        small[0].untyped_storage().data_ptr(), big.untyped_storage().data_ptr())
    model = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
    model[0].panel_weight = small[0]
    model[1].panel_weight = torch.zeros(huge_pages.MIN_BYTES // 4, dtype=torch.bfloat16)
    model[2].panel_weight = torch.ones(huge_pages.MIN_BYTES // 4, dtype=torch.bfloat16)
    outside = [model[1].panel_weight.data_ptr(), model[2].panel_weight.data_ptr()]
    assert huge_pages.gather_panels(model) > 0
    assert model[0].panel_weight is small[0]
    assert [m.panel_weight.data_ptr() for m in model[1:]] != outside
    assert not model[1].panel_weight.any() and model[2].panel_weight.all()


def test_huge_page_tensors():
    small = huge_pages.empty((4, 5), torch.bfloat16)
    assert small.shape == (4, 5) and small.dtype == torch.bfloat16
    n = huge_pages.MIN_BYTES // 4 + 3  # a ragged size: not whole huge pages
    big = huge_pages.empty((n,), torch.float32, zero=True)
    assert big.shape == (n,) and big.is_contiguous()
    assert big.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert int(big.count_nonzero()) == 0
    big[-1] = 7.0  # the last element is inside the map
    assert float(big[-1]) == 7.0
    if thp_mode() in ("always", "madvise"):
        # Most of it, not all: a fragmented host may fail to find a few free 2 MiB frames.
        assert huge_bytes(big) >= huge_pages.MIN_BYTES // 2


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"),
                    reason="transparent huge pages are off here")
def test_large_cache_is_on_huge_pages(tiny):
    llm = LLM(model=tiny, max_model_len=256, num_gpu_blocks_override=8192)
    kv = caches(llm)
    assert min(t.numel() * t.element_size() for t in kv) >= huge_pages.MIN_BYTES
    # Committed at start-up, so each tensor's whole 2 MiB pages are backed (most of them as
    # huge pages: a fragmented host may fail to find a few free 2 MiB frames).
    for t in kv:
        assert huge_bytes(t) >= t.numel() * t.element_size() // 2
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4,
                                                                    temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4


def test_gather_panels_moves_each_small_2_byte_tensor_once_with_its_values():
    g = torch.Generator().manual_seed(0)
    half = huge_pages.MIN_BYTES // 2  # bytes: two such matrices together pass MIN_BYTES
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(5)))
    panels = [torch.randn(half // 2 + 96, generator=g).to(dtype).view(-1, 8)
              for dtype in (torch.bfloat16, torch.float16)]
    panels.append(torch.randn(333, 7, generator=g))  # float32: left where it is
    panels.append(huge_pages.empty((huge_pages.MIN_BYTES // 2,), torch.bfloat16))  # packed huge
    for i, p in enumerate(panels):
        model[i].panel_weight = p
    model[4].panel_weight = panels[0]  # shared, as a tied LM head's
    want = [p.clone() for p in panels[:2]]
    before = [p.data_ptr() for p in panels]
    released = []
    moved = huge_pages.gather_panels(model, release=lambda: released.append(1))
    got = [model[i].panel_weight for i in range(5)]
    for w, t, ptr in zip(want, got, before):
        assert t.dtype == w.dtype and t.shape == w.shape and torch.equal(t, w)
        assert t.data_ptr() % 64 == 0 and t.data_ptr() != ptr
    assert got[4].data_ptr() == got[0].data_ptr()  # still one tensor
    assert [t.data_ptr() for t in got[2:4]] == before[2:4]
    assert moved == sum(-(-w.numel() * 2 // 64) * 64 for w in want)
    assert released  # freed heap memory handed back at the end
    if thp_mode() in ("always", "madvise"):
        assert huge_bytes(got[0]) >= huge_pages.MIN_BYTES // 2
    # Too few bytes to be worth a map: left where they are.
    small = nn.Linear(2, 2)
    small.panel_weight = torch.ones(16, 16, dtype=torch.bfloat16)
    before = small.panel_weight.data_ptr()
    assert huge_pages.gather_panels(small) == 0 and small.panel_weight.data_ptr() == before


def test_gather_blocks_moves_each_quantized_tensor_once_with_its_values():
    """A layer's qweight_data and a sharded layer's uint8 shards move into one map (a tensor
    two layers share, once), an embedding reading a moved table follows it, one that does not
    stays, 2-byte shards stay, and `release` gets each original after its copy."""
    g = torch.Generator().manual_seed(1)
    quarter = huge_pages.MIN_BYTES // 4
    blocks = [torch.randint(0, 256, (quarter // 40 + 3, 2, 20), generator=g,
                            dtype=torch.uint8) for _ in range(4)]
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(5)))
    model[0].qweight_data, model[1].qweight_data = blocks[0], blocks[1]
    panels = torch.ones(8, 4, dtype=torch.bfloat16)
    model[2].quant_shards = (("q4_k", 0, blocks[2]), ("bf16", 7, panels), ("q6_k", 9, blocks[3]))
    model[3].qweight_data = blocks[0]  # a tied LM head's table, shared
    model[3].row_lookup = type("Rows", (), {})()
    model[3].row_lookup.blocks = blocks[0]
    model[4].row_lookup = type("Rows", (), {})()
    own_table = torch.zeros(3, 2, 20, dtype=torch.uint8)  # looked up only: stays
    model[4].row_lookup.blocks = own_table
    want = [b.clone() for b in blocks]
    released = []
    moved = mapped_blocks.gather_blocks(model, release=lambda t: released.append(t.data_ptr()))
    if not huge_pages.supported():
        assert moved == 0
        return
    got = [model[0].qweight_data, model[1].qweight_data, model[2].quant_shards[0][2],
           model[2].quant_shards[2][2]]
    for w, t, before in zip(want, got, blocks):
        assert torch.equal(t, w) and t.data_ptr() != before.data_ptr()
        assert t.data_ptr() % 64 == 0
    assert model[3].qweight_data.data_ptr() == got[0].data_ptr()
    assert model[3].row_lookup.blocks.data_ptr() == got[0].data_ptr()
    assert model[4].row_lookup.blocks is own_table
    assert model[2].quant_shards[1] == ("bf16", 7, panels)
    assert [s[:2] for s in model[2].quant_shards] == [("q4_k", 0), ("bf16", 7), ("q6_k", 9)]
    assert sorted(released) == sorted(b.data_ptr() for b in blocks)
    assert moved == sum(-(-b.nbytes // 64) * 64 for b in blocks)
    # Too few bytes to be worth a map: left where they are.
    small = nn.Linear(2, 2)
    small.qweight_data = torch.zeros(4, 2, 20, dtype=torch.uint8)
    before = small.qweight_data.data_ptr()
    assert mapped_blocks.gather_blocks(small) == 0 and small.qweight_data.data_ptr() == before


def streamed_of(model: nn.Module) -> list[torch.Tensor]:
    """The block tensors a GGUF model's layers stream."""
    streamed = [m.qweight_data for m in model.modules()
                if isinstance(getattr(m, "qweight_data", None), torch.Tensor)]
    return streamed + [s[2] for m in model.modules()
                       for s in getattr(m, "quant_shards", None) or ()]


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"),
                    reason="transparent huge pages are off here")
def test_default_gguf_streams_its_blocks_from_huge_pages(monkeypatch):
    """The embedded SmolLM2 on its Q4_1 blocks: every block tensor the layers stream ends on
    huge pages, by default moved there under the same addresses after the load (anonymous
    memory once the move has ended, the model serving meanwhile), or left on the file's 2 MiB
    folios with PAGEDLM_GGUF_IN_PLACE=1 where the page cache has them; the tied embedding reads
    the LM head's blocks; and greedy tokens and logprobs are the very ones the file's own pages
    give (PAGEDLM_DISABLE_HUGE_PAGES=1): the same kernels on the same bytes."""
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=0)
    outs, models, at_load = {}, {}, {}

    def run(llm) -> tuple[str, list[int], list[float]]:
        out = llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0]
        return (out.text, list(out.token_ids),
                [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)])

    for how, disable, in_place in (("file pages", "1", ""), ("moved", "", ""),
                                   ("in place", "", "1")):
        monkeypatch.setenv("PAGEDLM_DISABLE_HUGE_PAGES", disable)
        monkeypatch.setenv("PAGEDLM_GGUF_IN_PLACE", in_place)
        llm = LLM(quantization="gguf", max_model_len=256, kv_cache_memory_bytes=64 * 2**20)
        models[how] = model = llm.llm_engine.executor.worker.model
        at_load[how] = [t.data_ptr() for t in streamed_of(model)]
        outs[how] = run(llm)  # the move may still run: every read sees the same bytes
        if how == "moved":
            assert model.blocks_move.wait(60)
            assert outs[how] == run(llm)
        else:
            assert not hasattr(model, "blocks_move")
        del llm
    assert outs["file pages"] == outs["moved"] == outs["in place"]
    assert "Paris" in outs["moved"][0]
    for how in ("moved", "in place"):
        model = models[how]
        streamed = streamed_of(model)
        assert [t.data_ptr() for t in streamed] == at_load[how]
        assert len(streamed) >= 121  # 30 layers x 4 linears and the tied LM head
        assert (model.embed_tokens.row_lookup.blocks.data_ptr()
                == model.lm_head.qweight_data.data_ptr())
    # Moved: every piece, and the blocks' maps (one a piece) are now anonymous memory, mostly
    # on huge pages (as many as the kernel had free when each piece was copied; the copied
    # arena before it was held to the same half). In place: one file map, mostly on 2 MiB
    # entries.
    move = models["moved"].blocks_move
    streamed = streamed_of(models["moved"])
    assert move.pieces and move.moved == sum(n for _, n in move.pieces)
    total = sum(t.nbytes for t in streamed)
    maps = {}
    for t in streamed:
        fields = map_fields(t)
        assert 0 < fields["Rss"] == fields.get("Anonymous", 0), (t.data_ptr(), fields)
        maps[fields["map_start"]] = fields
    huge = sum(f.get("AnonHugePages", 0) for f in maps.values())
    assert huge >= total // 2, (huge, total, list(maps.values()))
    streamed = streamed_of(models["in place"])
    assert huge_bytes(streamed[0]) >= sum(t.nbytes for t in streamed) // 2, map_fields(streamed[0])


@needs_kernels  # the panels are the native kernels' layout
@pytest.mark.skipif(thp_mode() not in ("always", "madvise"),
                    reason="transparent huge pages are off here")
def test_default_model_streams_its_panels_from_huge_pages():
    llm = LLM(dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=64 * 2**20)
    model = llm.llm_engine.executor.worker.model
    panels = {m.panel_weight.data_ptr(): m.panel_weight for m in model.modules()
              if isinstance(getattr(m, "panel_weight", None), torch.Tensor)}
    assert len(panels) >= 121  # 30 layers x 4 fused linears and the tied LM head
    total = sum(t.numel() * t.element_size() for t in panels.values())
    # Large panels have maps of their own; the small ones share a few (huge_pages.Arena).
    maps = {map_fields(t)["map_start"]: t for t in panels.values()}
    assert len(maps) < len(panels) // 4
    assert sum(huge_bytes(t) for t in maps.values()) >= total // 2
    out = llm.generate(["The capital of France is"],
                       SamplingParams(max_tokens=6, temperature=0))
    assert "Paris" in out[0].outputs[0].text


def test_file_maps_reads_smaps():
    """A file map counts as huge when nearly all its mapped pages are on 2 MiB entries; a
    file map mostly on 4 KiB pages does not, and an anonymous map is no file map."""
    smaps = "\n".join([
        "7f0000000000-7f0028000000 r--p 00200000 fe:01 1234    /models/a.gguf",
        "Size:             655360 kB", "Rss:              655360 kB",
        "FilePmdMapped:    651264 kB", "Anonymous:             0 kB", "VmFlags: rd mr me ms hg",
        "7f1000000000-7f1028000000 r--p 00000000 fe:01 1235    /models/my model.gguf",
        "Size:             655360 kB", "Rss:              655360 kB",
        "Anonymous:             8 kB", "FilePmdMapped:      6144 kB",
        "7f2000000000-7f2028000000 rw-p 00000000 00:00 0 ",
        "Size:             655360 kB", "Rss:              655360 kB",
        "AnonHugePages:    655360 kB", "FilePmdMapped:         0 kB",
    ])
    a, b = mapped_blocks.file_maps(smaps)
    assert a == mapped_blocks.FileMap(0x7f0000000000, 0x7f0028000000, 0x200000, 1234,
                                   "/models/a.gguf", rss=655360 << 10,
                                   pmd_mapped=651264 << 10, anonymous=0)
    assert a.huge and not b.huge
    assert (b.path, b.inode, b.anonymous, b.pmd_mapped) == ("/models/my model.gguf", 1235,
                                                           8192, 6144 << 10)


def _uncached_file(path, n: int) -> None:
    """Write n random bytes to path and drop them from the page cache."""
    import os
    path.write_bytes(torch.randint(0, 256, (n,), dtype=torch.uint8).numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean now: the cache drops it
    finally:
        os.close(fd)


def _advised_blocks(path, n: int):
    """A private map of path advised for huge pages, as the GGUF loader's, and a layer whose
    blocks view all of it but its last huge page."""
    import mmap
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    mapped_blocks.advise_file_map(m)
    layer = torch.nn.Module()
    layer.qweight_data = torch.frombuffer(m, dtype=torch.uint8)[:n - huge_pages.HUGE_PAGE]
    return m, layer


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"),
                    reason="transparent huge pages are off here")
def test_blocks_on_a_file_map_of_huge_folios_stay_in_place(tmp_path):
    """A file read through a map advised for huge pages, with its pages not yet cached: where
    the file system keeps 2 MiB folios (ext4 on Linux 6.16+), the map is then on 2 MiB entries
    and gather_blocks, asked to, leaves its blocks there (no copy, no release); elsewhere it
    moves them."""
    path, n = tmp_path / "blocks.bin", 32 * huge_pages.HUGE_PAGE
    _uncached_file(path, n)
    _, layer = _advised_blocks(path, n)
    blocks = layer.qweight_data
    expected = blocks.clone()
    released = []
    in_place = mapped_blocks.on_huge_file_pages([blocks]) == {blocks.data_ptr()}
    moved = mapped_blocks.gather_blocks(layer, release=released.append, in_place=True)
    if in_place:
        assert moved == 0 and not released and layer.qweight_data is blocks
    else:
        assert moved >= blocks.nbytes and len(released) == 1
    assert torch.equal(layer.qweight_data, expected)
    if not in_place:
        pytest.skip("this file system kept no 2 MiB folios of the file: the blocks moved")


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"),
                    reason="transparent huge pages are off here")
def test_a_file_cached_in_small_folios_is_read_again_onto_huge_ones(tmp_path):
    """A file the page cache holds in 4 KiB folios (faulted in page by page through a map
    without the advice, readahead off) stays in them until it is dropped; on_huge_file_pages
    reads such a map again, and its blocks then stay in place, unchanged. Needs a file system
    that gives 2 MiB folios to an advised map in the first place (the test above)."""
    import mmap
    path, n = tmp_path / "blocks.bin", 32 * huge_pages.HUGE_PAGE
    _uncached_file(path, n)
    probe, layer = _advised_blocks(path, n)
    if mapped_blocks.on_huge_file_pages([layer.qweight_data]) != {layer.qweight_data.data_ptr()}:
        pytest.skip("this file system keeps no 2 MiB folios of a file")
    del layer
    probe.close()
    _uncached_file(path, n)
    with open(path, "rb") as f:
        plain = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    plain.madvise(mmap.MADV_RANDOM)  # one 4 KiB folio per fault, no readahead
    expected = torch.frombuffer(bytearray(plain[:n - huge_pages.HUGE_PAGE]), dtype=torch.uint8)
    plain.close()

    m, layer = _advised_blocks(path, n)
    blocks = layer.qweight_data
    int(blocks[::4096].sum())  # maps the cached small folios, as a first touch would
    mine = [f for f in mapped_blocks.file_maps(open("/proc/self/smaps").read())
            if f.start <= blocks.data_ptr() < f.end]
    assert len(mine) == 1 and mine[0].rss >= blocks.nbytes and mine[0].pmd_mapped == 0
    assert mapped_blocks.on_huge_file_pages([blocks]) == {blocks.data_ptr()}
    assert mapped_blocks.gather_blocks(layer, in_place=True) == 0
    assert layer.qweight_data is blocks and torch.equal(blocks, expected)
    # By default they are copied all the same (gather_blocks says why).
    assert mapped_blocks.gather_blocks(layer) >= blocks.nbytes
    assert layer.qweight_data is not blocks and torch.equal(layer.qweight_data, expected)


def test_move_pieces_cover_the_spans_in_whole_huge_pages_within_the_map():
    """Spans rounded out to huge pages and clipped to the map (its end to a 4 KiB page), those
    less than a huge page apart joined, cut where a _MOVE_PIECE ends."""
    page, piece = huge_pages.HUGE_PAGE, mapped_blocks._MOVE_PIECE
    lo = 100 * piece + 4096  # a map that starts inside a huge page
    hi = lo + 3 * piece + 5000
    spans = [(lo + 10, 100),                          # clipped to the map's start
             (lo + 3 * page, page),                   # joined with the next (gap < a page)
             (lo + 4 * page + 8192, 2 * piece),       # across two piece boundaries
             (hi - 10, 10)]                           # clipped to the map's end, page-rounded
    pieces = mapped_blocks._pieces(lo, hi, spans)
    first_page = lo - lo % page + page
    assert pieces[0] == (lo, first_page - lo)
    starts = [a for a, _ in pieces]
    assert starts == sorted(starts)
    for (a, n), (b, _) in zip(pieces, pieces[1:]):
        assert a + n <= b
    for a, n in pieces[1:]:
        assert a % page == 0 and a // piece == (a + n - 1) // piece  # within one piece
        assert (a + n) % page == 0 or a + n == -(-hi // 4096) * 4096
    assert pieces[-1][0] + pieces[-1][1] == -(-hi // 4096) * 4096
    covered = [(a, a + n) for a, n in pieces]
    for start, n in spans:
        assert any(a <= start and start + n <= b for a, b in _joined(covered))
    # The gap of more than a huge page between the first span's page and the second stays out.
    assert not any(a < lo + 2 * page <= a + n - 1 for a, n in pieces if a > first_page)


def _joined(ranges):
    out = []
    for a, b in ranges:
        if out and a == out[-1][1]:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def test_file_map_move_keeps_addresses_and_bytes_while_others_read(tmp_path):
    """A private map of a file, as the GGUF loader's: the move puts fresh anonymous pages under
    the spans at the same addresses, with the same bytes, while another thread keeps reading
    them (every read sees the file's bytes); the pages outside the spans stay the file's."""
    import mmap
    import threading
    page = huge_pages.HUGE_PAGE
    path, n = tmp_path / "blocks.bin", 24 * page + 12345
    path.write_bytes(torch.randint(0, 256, (n,), dtype=torch.uint8).numpy().tobytes())
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    whole = torch.frombuffer(m, dtype=torch.uint8)
    expected = whole.clone()
    blocks = whole[3 * page + 100: 20 * page]  # 17 huge pages' worth, rounded out to 18
    ptr, total = blocks.data_ptr(), int(blocks.sum())
    stop, reading, bad, reads = threading.Event(), threading.Event(), [], [0]

    def reader():
        while not stop.is_set():
            reads[0] += 1
            if int(blocks.sum()) != total:
                bad.append(reads[0])
            reading.set()

    thread = threading.Thread(target=reader)
    thread.start()
    assert reading.wait(10)
    lo = whole.data_ptr()
    move = mapped_blocks.FileMapMove(m, lo, lo + n, [(ptr, blocks.nbytes)])
    assert move.wait(60)
    stop.set()
    thread.join()
    assert not bad and reads[0] > 0
    rounded = -(-(ptr + blocks.nbytes) // page) * page - ptr // page * page
    assert move.moved == sum(k for _, k in move.pieces) == rounded
    assert blocks.data_ptr() == ptr and torch.equal(whole, expected)
    fields = map_fields(blocks)
    assert fields["Rss"] == fields.get("Anonymous", 0) > 0
    if thp_mode() in ("always", "madvise"):
        assert fields.get("AnonHugePages", 0) > 0
    outside = map_fields(whole[-100:])  # past the spans' last huge page: the file's
    assert outside.get("Anonymous", 0) == 0
