"""The worker runtime, the floor the Trainer stands on: the launch contracts a process reads from its environment,
the process group, the rank layout (topology) and stop requests. It imports nothing of distaccum outside this
package: the launchers (:mod:`distaccum.cluster`) and the Trainer import it, never the other way."""
