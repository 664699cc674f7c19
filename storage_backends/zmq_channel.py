"""Old import path of :mod:`tierkv.storage_backends.zmq.channel` (the ZMQ request channel), kept for importers."""
from tierkv.storage_backends.zmq.channel import *  # noqa: F401,F403
from tierkv.storage_backends.zmq.channel import ID_MASK, ChannelFailed, RequestChannel  # noqa: F401
