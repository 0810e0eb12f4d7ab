"""Stand-in of the parts of sglang/srt/server_args.py @ 8905cbd42f4a that a transfer-backend plugin touches."""
import argparse

DISAGG_TRANSFER_BACKEND_CHOICES = ["mooncake", "nixl", "ascend", "fake", "mori", "mooncake_tcp"]


def add_disagg_transfer_backend_choices(choices):
    DISAGG_TRANSFER_BACKEND_CHOICES.extend(choices)


def parse(argv):
    """The --disaggregation-transfer-backend option as ServerArgs builds it (choices=the list, at parse time)."""
    p = argparse.ArgumentParser()
    p.add_argument("--disaggregation-transfer-backend", default="mooncake", choices=DISAGG_TRANSFER_BACKEND_CHOICES)
    p.add_argument("--disaggregation-mode", default="null")
    return p.parse_args(argv)
