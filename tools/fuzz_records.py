"""Coverage-guided fuzzing of the frame scanner and the record decoder (atheris/libFuzzer).

Every input is scanned as a stream of frames; every frame that passes its CRC is decoded.
Anything but a ``Frame``/``BadFrame``/``NEED_DATA`` from the scanner, or an exception other
than ``RecordError`` from the decoder, is a crash that libFuzzer saves. The first input
byte also picks a frame type for a direct decode of the rest, so payloads that would never
pass a CRC by chance still reach the decoder.

    python -m tools.fuzz_records -runs=1000000        # libFuzzer flags pass through
"""

from __future__ import annotations

import contextlib
import sys

import atheris  # type: ignore[import-untyped, import-not-found, unused-ignore]

with atheris.instrument_imports():
    from spool import format as fmt
    from spool import records as rec
    from spool.framing import NEED_DATA, BadFrame, Frame, Scanner

TYPES = sorted(fmt.FRAME_TYPES)


def decode(ftype: int, payload: bytes) -> None:
    with contextlib.suppress(rec.RecordError):
        if ftype == fmt.T_BODY:
            rec.decode_body(payload)
        elif ftype != fmt.T_PAD:
            rec.decode(ftype, payload)


def test_one_input(data: bytes) -> None:
    if data:
        decode(TYPES[data[0] % len(TYPES)], data[1:])
    scanner = Scanner()
    scanner.feed(data)
    while True:
        result = scanner.next()
        if isinstance(result, Frame):
            decode(result.type, result.payload)
            continue
        assert isinstance(result, BadFrame) or result is NEED_DATA, result
        return


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
