"""Training on several processes or machines with Ray ([distributed].backend = "ray"):
data-parallel gradients over replicas of the adapter and rollouts sampled on the workers.
`Cluster` (cluster.py) runs the workers, `Replica` (replica.py) is one worker, `RemoteGenerator`
(remote_gen.py) is the generator the RL recipes sample with. Ray is imported only when a run asks
for it (the optional extra retrograd[ray])."""

from retrograd.distributed.cluster import Cluster, ClusterError, workers_for

__all__ = ["Cluster", "ClusterError", "workers_for"]
