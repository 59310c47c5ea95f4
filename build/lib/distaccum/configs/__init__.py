# The packaged Hydra configs (`pkg://distaccum.configs`); distaccum/configs links here.
