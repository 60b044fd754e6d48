"""The wire: what the controller and the executors both speak. Executors import flowkit only
through here and the op contract (flowkit.ops, flowkit.dsl).

- protocol.py: messages (msgpack headers, a protocol version, frames); task.py: a task, as
  the controller sends it and an executor runs it (TaskSpec); schema.py: ProtocolError and the
  field checks both use; serialize.py: values as headers plus raw frames, never pickle; shm.py:
  shared memory between processes of one host and chunked frames between hosts; auth.py: keys
  and CurveZMQ; refs.py: references to objects that live on executors.
"""
