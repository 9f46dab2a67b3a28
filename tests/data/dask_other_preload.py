"""A worker preload with an option of its own, as dask-cuda's dask_cuda.initialize has
(--create-cuda-context): under `dask cuda worker` every preload gets the same arguments."""

import click


@click.command()
@click.option("--create-cuda-context/--no-create-cuda-context", default=False)
def dask_setup(worker, create_cuda_context):
    worker._test_other_preload_ran = create_cuda_context
