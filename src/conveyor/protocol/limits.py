"""The bounds of the client protocol: how large a message, a field or a request may be.

One place for every number a client may hit (docs/protocol.md lists them), read by the
parsers (:mod:`conveyor.protocol.wire`, :mod:`conveyor.protocol.requests`,
:mod:`conveyor.protocol.sampling_fields`), by the transports that size their frames to them
(:mod:`conveyor.ipc.transport`, the HTTP server) and by the OpenAI layer that mirrors them.
"""

from __future__ import annotations

MAX_CLIENT_MESSAGE_BYTES = 8 * 1024 * 1024
MAX_REQUEST_ID_LEN = 256
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
# Most ``stop_token_ids`` one request may give: each is checked against every sampled token of
# every step, so a million of them slowed every neighbour's steps (TTFT 1.3 s -> 7.9 s).
MAX_STOP_TOKEN_IDS = 1024
# Decode limits of a client frame (:func:`unpack_map`), besides its size: they bound the
# objects one frame can make (a valid request needs far less: an array is at most a prompt's
# token ids, a map a request's fields). Nesting deeper than msgpack's own stack (1024
# levels) is refused by the decoder itself.
MAX_ARRAY_LEN = 1 << 20
# Maps: 16,384 keys, far above what a request needs (``logit_bias``: 1,024 entries; a JSON
# schema's or a tool's ``properties``, whose OpenAI limit is 5,000 in all).
MAX_MAP_LEN = 16384
MAX_EXT_LEN = 64
# How much of an undecodable frame is read for its request id (:func:`recover_request_id`).
RECOVER_SCAN_BYTES = 1 << 20
RECOVER_SCAN_KEYS = 64
# Nesting of a JSON body of the HTTP face: far beyond any real schema or tool list, and well
# below what would exhaust the decoders' stacks (msgpack's packer stops at 512 levels, Python's
# recursion near 1,000), so a deeper body is a 400 naming its field, never a 500.
MAX_JSON_DEPTH = 128
# Most sequences one request may ask for (``n``): each is a sequence at the scheduler, with a
# detokenizer and stop strings of its own in the frontend, so one message must not fan out
# without bound. Each sequence must fit the KV pool on its own (the scheduler's check), and
# they run side by side as the pool and --max-num-seqs allow.
MAX_N = 64
MAX_PRIORITY = 2**31 - 1  # |priority| bound: any int32
MAX_LORA_NAME_LEN = 256  # length bound of a LoRA adapter's name
MAX_LORA_PATH_LEN = 4096  # length bound of the directory a load_lora names
# Seeds: any 64-bit integer, signed or unsigned, is accepted and stored as the signed 64-bit
# value with the same bit pattern (the sampler keys its draws by those 64 bits).
MIN_SEED = -(2**63)
SEED_END = 2**64
# The packed size bound of ``chat_template_kwargs`` (its values reach the template as they are).
MAX_TEMPLATE_KWARGS_BYTES = 32 * 1024
DEFAULT_PROFILE_WINDOW_S = 60.0
MAX_PROFILE_WINDOW_S = 3600.0
MAX_PROFILE_SERIES = 32
