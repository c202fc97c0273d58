"""``tracer.cache(...)`` and streaming generation on the tiny GPT-2 / Llama (see conftest.py),
checked against plain transformers with forward hooks and HF's own streamers."""

from __future__ import annotations

import threading

import pytest
import torch
import transformers
from tests.integration.conftest import layers

import nnsight_lite

PROMPT = "the eiffel tower is in the city of"
SHORT = "hello world"


def hooked(hf, modules, fn):
    """Run ``fn()`` with forward hooks on ``modules`` (name -> module); return its result and
    {name: [output per call]}."""
    seen = {name: [] for name in modules}
    handles = [m.register_forward_hook(lambda mod, a, o, name=name: seen[name].append(o))
               for name, m in modules.items()]
    try:
        return fn(), seen
    finally:
        for h in handles:
            h.remove()


def block_names(arch, n=3):
    base = "transformer.h" if arch == "gpt2" else "model.layers"
    return [f"{base}.{i}" for i in range(n)]


class TestCacheOnLanguageModels:
    def test_trace_cache_equals_plain_hooks(self, lm, hf, arch):
        """Every block's and lm_head's cached output equals a plain hook's on the same prompt;
        the keys are "model." + named_modules() paths, and navigation reaches the same."""
        with lm.trace(PROMPT) as tracer:
            cache = tracer.cache()
        enc = lm.tokenizer(PROMPT, return_tensors="pt")
        mods = dict(hf.named_modules())
        names = block_names(arch) + ["lm_head"]
        _, seen = hooked(hf, {n: mods[n] for n in names}, lambda: hf(**enc))
        for name in names:
            torch.testing.assert_close(cache["model." + name].output, seen[name][0])
        assert layers(cache, arch)[1].output is cache["model." + names[1]].output
        assert list(cache.keys())[-1] == "model"  # the root's output comes last
        assert set(cache.keys()) <= {"model." + n if n else "model" for n in mods} | {"model"}

    def test_llama_navigation_from_model(self, model_dirs):
        """On Llama, whose decoder is the child `model`, cache.model.layers[0] and
        cache.model.model.layers[0] both reach "model.model.layers.0"."""
        lm = quiet_lm(model_dirs["llama"])
        with lm.trace(PROMPT) as tracer:
            cache = tracer.cache(modules=[lm.model.layers[0]])
        want = cache["model.model.layers.0"].output
        assert cache.model.layers[0].output is want
        assert cache.model.model.layers[0].output is want

    def test_edit_earlier_in_the_body(self, lm, hf, arch):
        """With block 0's output scaled in the body, the cache holds the scaled block 0 and the
        later blocks computed from it, as plain hooks doing the same edit see them."""
        with lm.trace(PROMPT) as tracer:
            cache = tracer.cache(modules=[layers(lm, arch)[0], layers(lm, arch)[2]])
            layers(lm, arch)[0].output = layers(lm, arch)[0].output * 0.5   # a replacement
        enc = lm.tokenizer(PROMPT, return_tensors="pt")
        h = layers(hf, arch)[0].register_forward_hook(lambda m, a, o: o * 0.5)
        try:
            mods = dict(hf.named_modules())
            names = block_names(arch)
            _, seen = hooked(hf, {names[2]: mods[names[2]]}, lambda: hf(**enc))
        finally:
            h.remove()
        torch.testing.assert_close(cache["model." + names[2]].output, seen[names[2]][0])
        plain0 = hooked(hf, {names[0]: mods[names[0]]}, lambda: hf(**enc))[1][names[0]][0]
        torch.testing.assert_close(cache["model." + names[0]].output, plain0 * 0.5)

    def test_invoke_rows_are_padded_to_the_batch(self, lm, hf, arch):
        """A cache in the short prompt's invoke holds its row at the batch's padded length,
        equal to that row of the plain left-padded batch; an empty invoke holds every row."""
        with lm.trace() as tracer:
            with tracer.invoke(SHORT):
                short = tracer.cache(modules=[layers(lm, arch)[1]])
            with tracer.invoke(PROMPT):
                pass
            with tracer.invoke():
                both = tracer.cache(modules=[layers(lm, arch)[1]])
        enc = lm.tokenizer([SHORT, PROMPT], return_tensors="pt", padding=True,
                           padding_side="left")
        mask = enc["attention_mask"]
        pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        name = block_names(arch)[1]
        _, seen = hooked(hf, {name: dict(hf.named_modules())[name]},
                         lambda: hf(**enc, position_ids=pos))
        key = "model." + name
        assert short[key].output.shape[:2] == (1, enc["input_ids"].shape[1])
        torch.testing.assert_close(short[key].output, seen[name][0][:1])
        torch.testing.assert_close(both[key].output, seen[name][0])

    def test_generate_one_entry_per_step(self, lm, hf, arch):
        """In generate, a module's entry has one value per step, each equal to a plain hook's
        at that call of HF generate; the tokens are the same."""
        k = 4
        with lm.generate(PROMPT, max_new_tokens=k, min_new_tokens=k, do_sample=False) as tracer:
            cache = tracer.cache(modules=[layers(lm, arch)[-1], "model.lm_head"])
        enc = lm.tokenizer(PROMPT, return_tensors="pt")
        name = block_names(arch)[-1]
        plain, seen = hooked(
            hf, {name: dict(hf.named_modules())[name], "lm_head": hf.lm_head},
            lambda: hf.generate(**enc, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                                pad_token_id=1))
        assert torch.equal(tracer.result, plain)
        assert list(cache.keys()) == ["model." + name, "model.lm_head"]
        for n in (name, "lm_head"):
            entry = cache["model." + n]
            assert len(entry) == k and isinstance(entry.output, list)
            for got, want in zip(entry.output, seen[n]):
                torch.testing.assert_close(got, want)

    def test_generate_with_edits_at_every_step(self, lm, hf):
        """A body forcing token 7 through lm_head at every step (tracer.all()): the cache holds
        the edited logits of each step, and the tokens are those of plain hooks doing the same."""
        k = 3
        with lm.generate(PROMPT, max_new_tokens=k, do_sample=False) as tracer:
            cache = tracer.cache(modules=["lm_head"])
            for step in tracer.all():
                lm.lm_head.output[:, -1, 7] = 1e4

        def force(m, a, out):
            out = out.clone()
            out[:, -1, 7] = 1e4
            return out

        enc = lm.tokenizer(PROMPT, return_tensors="pt")
        h = hf.lm_head.register_forward_hook(force)
        try:
            plain, seen = hooked(hf, {"lm_head": hf.lm_head}, lambda: hf.generate(
                **enc, max_new_tokens=k, do_sample=False, pad_token_id=1))
        finally:
            h.remove()
        assert torch.equal(tracer.result, plain)
        assert len(cache["model.lm_head"]) == k
        for got, want in zip(cache["model.lm_head"].output, seen["lm_head"]):
            torch.testing.assert_close(got, want)
            assert (got[:, -1, 7] == 1e4).all()

    def test_skip_a_block(self, lm, arch):
        """A block skipped with its input as output: the cache holds that value for it, and
        the block's submodules have no entry."""
        with lm.trace(PROMPT) as tracer:
            cache = tracer.cache()
            blk = layers(lm, arch)[1]
            blk.skip(blk.input)
        name = "model." + block_names(arch)[1]
        torch.testing.assert_close(cache[name].output, cache["model." + block_names(arch)[0]].output)
        assert not [k for k in cache.keys() if k.startswith(name + ".")]
        assert any(k.startswith("model." + block_names(arch)[2] + ".") for k in cache.keys())


def quiet_lm(path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return nnsight_lite.LanguageModel(path, dispatch=True)


class _Collect(transformers.generation.streamers.BaseStreamer):
    """A streamer that keeps every ``put`` and counts ``end`` (HF's streamer protocol)."""

    def __init__(self):
        self.puts, self.ends = [], 0

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ends += 1


class TestStreaming:
    def test_text_iterator_streamer_from_another_thread(self, lm, hf):
        """HF's TextIteratorStreamer passed to a traced generate, consumed by this thread while
        another runs the generate: the streamed text equals what the same streamer gives for
        plain HF generate, and the tokens equal the final ids."""
        k = 5
        streamer = transformers.TextIteratorStreamer(lm.tokenizer, timeout=60)
        box = {}

        def run():
            with lm.generate(PROMPT, max_new_tokens=k, do_sample=False, streamer=streamer) as tr:
                hs = nnsight_lite.save([])
                for step in tr.all():
                    hs.append(lm.lm_head.output.shape)
            box["ids"], box["steps"] = tr.result, len(hs)

        t = threading.Thread(target=run)
        t.start()
        pieces = list(streamer)
        t.join(60)
        plain_streamer = transformers.TextIteratorStreamer(lm.tokenizer, timeout=60)
        enc = lm.tokenizer(PROMPT, return_tensors="pt")
        u = threading.Thread(target=hf.generate, kwargs=dict(
            **enc, max_new_tokens=k, do_sample=False, pad_token_id=1, streamer=plain_streamer))
        u.start()
        plain_pieces = list(plain_streamer)
        u.join(60)
        assert pieces == plain_pieces and len(pieces) > 1
        assert "".join(pieces) == lm.tokenizer.decode(box["ids"][0])
        assert box["steps"] == k

    def test_streamed_tokens_equal_final_ids(self, lm):
        """A streamer gets the prompt ids, then each new token as it is made, then end():
        their concatenation is tracer.result; with trace=False too."""
        k = 4
        got = _Collect()
        with lm.generate(PROMPT, max_new_tokens=k, do_sample=False, streamer=got) as tracer:
            pass
        assert got.ends == 1 and len(got.puts) == k + 1
        assert torch.equal(torch.cat([got.puts[0][0]] + [p for p in got.puts[1:]]),
                           tracer.result[0])
        plain = _Collect()
        ids = lm.generate(PROMPT, max_new_tokens=k, do_sample=False, streamer=plain, trace=False)
        assert torch.equal(ids, tracer.result)
        assert [p.tolist() for p in plain.puts] == [p.tolist() for p in got.puts]

    def test_streamer_output_in_the_body(self, lm):
        """model.generator.streamer.output at step i is the prompt (i = 0), then the token
        made at step i - 1: the same as the generated ids."""
        k = 3
        with lm.generate(PROMPT, max_new_tokens=k, do_sample=False) as tracer:
            steps = nnsight_lite.save([])
            for step in tracer.iter[:k]:
                steps.append(lm.generator.streamer.output)
            ids = lm.generator.output.save()
        n = lm.tokenizer(PROMPT, return_tensors="pt")["input_ids"].shape[1]
        assert [tuple(s.shape) for s in steps] == [(1, n), (1,), (1,)]
        assert torch.equal(steps[0], ids[:, :n])
        assert [int(s) for s in steps[1:]] == ids[0, n:n + k - 1].tolist()

    def test_an_open_loop_over_the_streamer_sees_every_token(self, lm):
        """``for step in tracer.all():`` reading model.generator.streamer.output has one step
        more than the model's forwards (as in nnsight): the prompt, then every new token, the
        last one included; together they are the generated ids. A loop reading lm_head in the
        same generate still has one step per new token."""
        k = 3
        with lm.generate(PROMPT, max_new_tokens=k, min_new_tokens=k, do_sample=False) as tracer:
            toks = nnsight_lite.save([])
            for step in tracer.all():
                toks.append(lm.generator.streamer.output)
        with lm.generate(PROMPT, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                         streamer=_Collect()) as again:
            logits = nnsight_lite.save([])
            for step in again.all():
                logits.append(lm.lm_head.output)
        assert len(toks) == k + 1 and len(logits) == k
        assert torch.equal(torch.cat([toks[0][0]] + toks[1:]), tracer.result[0])
        assert torch.equal(again.result, tracer.result)

    def test_streamed_token_can_be_edited_for_the_user_streamer(self, lm):
        """An edit of model.generator.streamer.output reaches the user's streamer; the
        generated ids are unchanged (the streamer sees tokens, it does not make them)."""
        got = _Collect()
        with lm.generate(PROMPT, max_new_tokens=3, do_sample=False, streamer=got) as tracer:
            for step in tracer.iter[1:3]:
                lm.generator.streamer.output = torch.full_like(lm.generator.streamer.output, 2)
        plain = lm.generate(PROMPT, max_new_tokens=3, do_sample=False, trace=False)
        assert [p.tolist() for p in got.puts[1:3]] == [[2], [2]]
        assert torch.equal(tracer.result, plain)

    def test_no_streamer_unless_asked(self, lm, hf):
        """A generate whose body does not name the streamer runs HF without one, so beam
        search (which refuses streamers) still works."""
        with lm.generate(PROMPT, max_new_tokens=3, num_beams=2, do_sample=False) as tracer:
            last = lm.lm_head.output.save()
        enc = lm.tokenizer(PROMPT, return_tensors="pt")
        plain = hf.generate(**enc, max_new_tokens=3, num_beams=2, do_sample=False, pad_token_id=1)
        assert torch.equal(tracer.result, plain) and last.shape[0] == 2

    def test_streamer_only_in_generate(self, lm):
        with pytest.raises(nnsight_lite.NNsightError,
                           match=r"model.generator.streamer.output .* exists only inside"):
            with lm.trace("hello"):
                lm.generator.streamer.output.save()


def test_readme_streaming_example_runs(model_dirs, tmp_path):
    """The README's streaming example runs as written on the tiny GPT-2: the text streamed
    from the other thread is the decoded new tokens, and the in-body tokens have the
    documented shapes."""
    import re
    import runpy
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Language models", 1)[1].split("Streaming:", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    script = tmp_path / "readme_streaming.py"
    script.write_text(code)
    lm = quiet_lm(model_dirs["gpt2"])
    ns = runpy.run_path(str(script), init_globals={"model": lm, "nnsight_lite": nnsight_lite})
    plain = lm.generate("The Eiffel Tower is in", max_new_tokens=8, do_sample=False, trace=False)
    n = lm.tokenizer("The Eiffel Tower is in", return_tensors="pt")["input_ids"].shape[1]
    assert ns["streamed"].split() == lm.tokenizer.decode(plain[0, n:]).split()
    assert [tuple(t.shape) for t in ns["tokens"]] == [(1, n), (1,), (1,)]
