"""Test tokenizers shaped like the three families the frontend must match transformers on.

Each is trained here on a tiny corpus (so nothing is downloaded) and saved as a checkpoint
directory would ship it: ``tokenizer.json`` plus ``tokenizer_config.json``.

- ``bytelevel``: Llama-3 style byte-level BPE, BOS from the post-processor, no chat template.
- ``chatml``: Qwen2 style (NFC, Qwen's split regex, byte-level BPE, no BOS), ChatML template.
- ``spm``: Mistral style sentencepiece BPE with byte fallback (``<0xNN>`` pieces), the
  Metaspace pre-tokenizer and the decoder transformers' ``LlamaTokenizer`` builds.
- ``spm_legacy``: the same vocabulary in the older file layout Llama 2 ships (a normalizer
  that prepends ``▁`` and replaces spaces, no pre-tokenizer), which transformers 5 does not
  follow as saved.

Training is deterministic, so every run tests the same vocabularies.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from conveyor.checkpoints.demo.build_tokenizer import train_byte_level_bpe
from conveyor.checkpoints.demo.checkpoint import TOKENIZER_DIR as DEMO_DIR

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2024; we're testing tokenizers!",
    "Hello, world. Hello again: numbers 12345 and 3.14159, symbols #@$%^&*().",
    "Le café est déjà prêt. Crème brûlée, naïve façade, garçon, élève, Noël.",
    "Straße und Größe; Übermäßig schön. ¿Dónde está la niña? Mañana.",
    "def tokenize(text: str) -> list[int]:\n    return [ord(c) for c in text]\n",
    "Streaming detokenization must hold back incomplete characters.\n\nNew paragraph\twith tab.",
    "日本語のテキスト。你好世界。한국어.",
    "Emoji 😀 🎉 👍 🚀 and a family 👨‍👩‍👧 and flags 🇫🇷.",
] * 4

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
INST_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
    "{% endfor %}"
)


def _added(content: str) -> dict:
    return {
        "content": content,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "single_word": False,
        "special": True,
    }


def _save(path: Path, tok: Tokenizer, config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    added = {str(tok.token_to_id(t.content)): _added(t.content) for t in tok.get_added_tokens_decoder().values()}
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "added_tokens_decoder": added}, indent=1))
    return path


def build_bytelevel(path: Path) -> Path:
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tok = train_byte_level_bpe(CORPUS, LLAMA3_SPLIT, [bos, eos, "<|eot_id|>"], 420)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, 0)]),
        ]
    )
    return _save(path, tok, {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos})


def build_chatml(path: Path) -> Path:
    tok = train_byte_level_bpe(CORPUS, QWEN_SPLIT, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], 400, nfc=True)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "chat_template": CHATML_TEMPLATE,
    }
    return _save(path, tok, config)


def build_spm(path: Path) -> Path:
    specials = ["<unk>", "<s>", "</s>"]
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=specials + byte_pieces, show_progress=False)
    # CJK and emoji stay out of the vocabulary: they must fall back to bytes.
    tok.train_from_iterator([line for line in CORPUS if max(map(ord, line)) < 0x2000], trainer=trainer)
    # As shipped by Llama-2/Mistral: byte pieces live in the model vocabulary, not as added tokens,
    # and the whole input is one piece sequence (split=False), as transformers' LlamaTokenizer builds it.
    data = json.loads(tok.to_str())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] in specials]
    data["model"].update(unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    data["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
    tok = Tokenizer.from_str(json.dumps(data))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    config = {
        "tokenizer_class": "LlamaTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "legacy": False,
        "chat_template": INST_TEMPLATE,
    }
    return _save(path, tok, config)


def build_spm_legacy(path: Path) -> Path:
    build_spm(path)
    data = json.loads((path / "tokenizer.json").read_text())
    data["normalizer"] = {
        "type": "Sequence",
        "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        ],
    }
    data["pre_tokenizer"] = None
    (path / "tokenizer.json").write_text(json.dumps(data))
    return path


BUILDERS: dict[str, Callable[[Path], Path]] = {
    "bytelevel": build_bytelevel,
    "chatml": build_chatml,
    "spm": build_spm,
    "spm_legacy": build_spm_legacy,
}


@pytest.fixture(scope="session")
def tokenizer_dirs(tmp_path_factory) -> dict[str, Path]:
    """Name -> checkpoint directory, for the three test tokenizers and the demo one."""
    root = tmp_path_factory.mktemp("tokenizers")
    dirs = {name: build(root / name) for name, build in BUILDERS.items()}
    dirs["demo"] = DEMO_DIR
    return dirs


@pytest.fixture(scope="session")
def ours(tokenizer_dirs):
    """Name -> conveyor Tokenizer."""
    from conveyor.frontend.tokenizer import Tokenizer as ConveyorTokenizer

    return {name: ConveyorTokenizer.from_dir(path) for name, path in tokenizer_dirs.items()}


@pytest.fixture(scope="session")
def hf(tokenizer_dirs):
    """Name -> transformers AutoTokenizer, the reference (skipped where transformers is absent)."""
    import transformers

    return {name: transformers.AutoTokenizer.from_pretrained(str(path)) for name, path in tokenizer_dirs.items()}


# ---------------------------------------------------------------------- a live frontend


class GatedTokenizer:
    """Wraps a conveyor Tokenizer; its pooled encodes (``release_gil=True``, the frontend's
    thread pool), and with ``gate_inline`` also those on the event loop, wait for ``gate``, so a
    test decides exactly when a prompt is tokenized. ``entered`` is set once such an encode has
    started."""

    def __init__(self, base, gate_inline: bool = False) -> None:
        self._base = base
        self.gate_inline = gate_inline
        self.gate = threading.Event()
        self.entered = threading.Event()

    def __getattr__(self, name: str):
        return getattr(self._base, name)

    def encode(self, text: str, add_special_tokens: bool = True, *, release_gil: bool = False) -> list[int]:
        if release_gil or self.gate_inline:
            self.entered.set()
            if not self.gate.wait(30):
                raise TimeoutError("the test never opened the tokenizer gate")
        return self._base.encode(text, add_special_tokens, release_gil=release_gil)

    def apply_chat_template(
        self,
        messages,
        add_generation_prompt: bool = True,
        *,
        continue_final_message=False,
        variables=None,
        release_gil: bool = False,
    ):
        text = self._base.render_chat(
            messages, add_generation_prompt, continue_final_message=continue_final_message, variables=variables
        )
        return self.encode(text, add_special_tokens=False, release_gil=release_gil)


class LiveFrontend:
    """The frontend's asyncio loop on a thread, with a stand-in scheduler (two plain sockets on
    the frontend's internal addresses) and DEALER clients speaking the client protocol."""

    def __init__(self, tokenizer, **config) -> None:
        import uvloop
        import zmq

        from conveyor.frontend.server import Frontend
        from conveyor.ipc.transport import ServerAddresses, make_run_dir
        from conveyor.runtime.config import FrontendConfig

        self.zmq = zmq
        self.run_dir = make_run_dir()  # short: ipc paths are limited to ~100 characters
        self.addresses = ServerAddresses.in_run_dir(self.run_dir, f"ipc://{self.run_dir}/client")
        config = {"max_model_len": 4096, "vocab_size": tokenizer.vocab_size, **config}
        self.config = FrontendConfig(str(DEMO_DIR), self.addresses, **config)
        self.ctx = zmq.Context()
        self.from_frontend = self._socket(zmq.PULL, self.addresses.to_scheduler, bind=True)
        self.to_frontend = self._socket(zmq.PUSH, self.addresses.to_frontend, bind=False)
        self.control = self._socket(zmq.PUSH, self.addresses.frontend_control, bind=False)
        self.frontend = None
        started = threading.Event()
        self.error: list[BaseException] = []

        async def main() -> None:
            self.frontend = Frontend(self.config, tokenizer)
            started.set()
            try:
                await self.frontend.run()
            finally:
                self.frontend.close()

        def run() -> None:
            try:
                uvloop.run(main())
            except BaseException as exc:  # surfaced by stop()
                self.error.append(exc)
                started.set()

        self.thread = threading.Thread(target=run, name="frontend-loop", daemon=True)
        self.thread.start()
        assert started.wait(10) and not self.error, self.error

    def _socket(self, kind: int, address: str, *, bind: bool):
        sock = self.ctx.socket(kind)
        sock.setsockopt(self.zmq.LINGER, 0)
        sock.bind(address) if bind else sock.connect(address)
        return sock

    def client(self):
        """A DEALER socket connected to the client address."""
        import uuid

        sock = self.ctx.socket(self.zmq.DEALER)
        sock.setsockopt(self.zmq.LINGER, 0)
        sock.setsockopt(self.zmq.ROUTING_ID, uuid.uuid4().bytes)
        sock.connect(self.addresses.client)
        return sock

    def key(self, sock, request_id: str) -> tuple[bytes, str]:
        """A request's key in the frontend's tables and sessions (:attr:`RequestState.key`):
        (its client's key, here the socket's routing id; its id)."""
        return b"id:" + sock.getsockopt(self.zmq.ROUTING_ID), request_id

    @staticmethod
    def send(sock, **fields) -> None:
        import msgpack

        sock.send(msgpack.packb({"v": 1, **fields}))

    @staticmethod
    def recv(sock, timeout: float = 5.0) -> dict | None:
        """The next message on a client socket, or None after ``timeout`` seconds."""
        import msgpack

        if not sock.poll(int(timeout * 1000)):
            return None
        return msgpack.unpackb(sock.recv())

    def until_final(self, sock, timeout: float = 5.0) -> list[dict]:
        """Client messages up to and including the next ``final`` (fewer if ``timeout`` passes)."""
        out = []
        while (msg := self.recv(sock, timeout)) is not None:
            out.append(msg)
            if msg["type"] == "final":
                break
        return out

    @staticmethod
    def first_token(sid: str, token: int):
        """The scheduler's output of a request's first token (``sid``: its id at the scheduler)."""
        from conveyor.ipc.messages import RequestOutput, TokenOutputs

        now = time.time()
        return TokenOutputs([RequestOutput(sid, [token], scheduled_time=now, first_token_time=now)])

    def scheduler_recv(self, timeout: float = 5.0):
        """The next message the frontend sent the scheduler (decoded), or None after ``timeout`` s.
        An AddRequest's prompt (an int32 array on the wire) is read out as a list, as the
        scheduler does."""
        from conveyor.ipc import codec
        from conveyor.ipc.messages import AddRequest

        if not self.from_frontend.poll(int(timeout * 1000)):
            return None
        msg = codec.decode(self.from_frontend.recv())
        if isinstance(msg, AddRequest):
            msg.prompt_token_ids = msg.prompt_token_ids.tolist()
        return msg

    def scheduler_send(self, msg) -> None:
        from conveyor.ipc import codec

        self.to_frontend.send(codec.encode(msg))

    def wait_for(self, predicate, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.005)
        return predicate()

    def shutdown(self) -> None:
        """What bin/serve does on exit: Shutdown on the control line (every in-flight request
        gets an error final), then the loop ends; the test's sockets stay open."""
        from conveyor.ipc import codec
        from conveyor.ipc.messages import Shutdown

        if self.thread.is_alive():
            self.control.send(codec.encode(Shutdown("test over")))
            self.thread.join(10)

    def stop(self) -> None:
        self.shutdown()
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        assert not self.thread.is_alive(), "the frontend loop did not stop"
        assert not self.error, self.error


@pytest.fixture
def live_frontend(ours):
    """``start(tokenizer=None, **FrontendConfig fields) -> LiveFrontend`` on the demo tokenizer
    (or ``tokenizer``); every frontend started is shut down and checked afterwards."""
    started: list[LiveFrontend] = []

    def start(tokenizer=None, **config) -> LiveFrontend:
        fe = LiveFrontend(tokenizer or ours["demo"], **config)
        started.append(fe)
        return fe

    yield start
    for fe in started:
        fe.stop()


@pytest.fixture
def gated(ours) -> GatedTokenizer:
    """The demo tokenizer, its pooled encodes held until ``gated.gate`` is set (set at teardown)."""
    tok = GatedTokenizer(ours["demo"])
    yield tok
    tok.gate.set()
