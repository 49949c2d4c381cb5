"""One fast tokenizer shared by the engine thread, the event loop and the prompt and
request-preparation threads (transformers_utils/tokenizer.py's thread_tokenizer): get_tokenizer
fixes the state that encode would otherwise change per call, so concurrent encodes and decodes
give what one thread alone gives."""
from __future__ import annotations

import json
import os
import random
import shutil
import threading

from transformers import PreTrainedTokenizerFast

from pagedlm.transformers_utils.tokenizer import get_tokenizer, thread_tokenizer


def _tokenizer_dir_with_state(src: str, dst: str) -> str:
    """The default model's tokenizer files, its tokenizer.json asking for truncation at 8
    tokens and padding: the state a shared tokenizer's encode must never have to change."""
    os.makedirs(dst)
    for name in os.listdir(src):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(src, name), dst)
    path = os.path.join(dst, "tokenizer.json")
    with open(path) as f:
        spec = json.load(f)
    spec["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst",
                          "stride": 0}
    spec["padding"] = {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None,
                       "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"}
    with open(path, "w") as f:
        json.dump(spec, f)
    return dst


def test_threads_share_one_fast_tokenizer_without_changing_it(default_model_dir, tmp_path):
    tokenizer = get_tokenizer(_tokenizer_dir_with_state(default_model_dir, str(tmp_path / "t")))
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert thread_tokenizer(tokenizer) is tokenizer
    backend = tokenizer.backend_tokenizer
    assert backend.truncation is None and backend.padding is None

    rng = random.Random(0)
    words = ["serving", " engine", "paged", "attention", "é", "数据", "\n", "  ", "<|im_end|>",
             "12345", "tokens", "Hello", "world!"]
    texts = ["".join(rng.choice(words) for _ in range(rng.randint(20, 2000))) for _ in range(24)]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    decoded = [tokenizer.decode(i) for i in ids]
    assert max(len(i) for i in ids) > 1000  # untruncated, unpadded

    errors: list[BaseException] = []
    mismatches: list[int] = []

    def work(seed: int) -> None:
        r = random.Random(seed)
        try:
            for _ in range(150):
                k = r.randrange(len(texts))
                if seed % 2:
                    if tokenizer.encode(texts[k], add_special_tokens=False) != ids[k]:
                        mismatches.append(k)
                elif (tokenizer.decode(ids[k]) != decoded[k]
                      or len(tokenizer.convert_ids_to_tokens(ids[k])) != len(ids[k])):
                    mismatches.append(k)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not mismatches
    assert backend.truncation is None and backend.padding is None


def test_other_tokenizer_classes_get_a_copy_of_their_own():
    class PythonTokenizer:  # no Rust object: thread_tokenizer cannot vouch for sharing it
        def __init__(self):
            self.cache = {}

    tokenizer = PythonTokenizer()
    copy = thread_tokenizer(tokenizer)
    assert copy is not tokenizer and copy.cache is not tokenizer.cache
