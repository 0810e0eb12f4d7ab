from sglang.srt.disaggregation.base.conn import (  # noqa: F401
    BaseKVBootstrapServer, BaseKVManager, BaseKVReceiver, BaseKVSender, KVArgs, KVPoll)
