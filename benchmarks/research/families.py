"""Candidate table families (idea A). All keep the seed's window radius (4 * 3 * sigma_b + 1)."""
import functools

import numpy as np
from cost import family, mix_cdf, seed_tables
from scipy import stats


def t_cdf(nu):
    return lambda z: stats.t.cdf(z, nu)


def laplace_cdf(z):
    return np.where(z < 0, 0.5 * np.exp(np.minimum(z, 0) * np.sqrt(2)),
                    1 - 0.5 * np.exp(-np.maximum(z, 0) * np.sqrt(2)))


def logistic_cdf(z):
    return 1 / (1 + np.exp(-z * 1.8138))  # unit variance


SPECS = {
    "seed": lambda: seed_tables(),
    "seed_e1e-4": lambda: family(mix_cdf([0.9699, 0.0300], [1, 3]), esc=1e-4),
    "g2_90_10_w3": lambda: family(mix_cdf([0.90, 0.0999], [1, 3]), esc=1e-4),
    "g2_85_15_w25": lambda: family(mix_cdf([0.85, 0.1499], [1, 2.5]), esc=1e-4),
    "g2_80_20_w2": lambda: family(mix_cdf([0.80, 0.1999], [1, 2]), esc=1e-4),
    "g2_95_05_w4": lambda: family(mix_cdf([0.95, 0.0499], [1, 4]), esc=1e-4),
    "g3_a": lambda: family(mix_cdf([0.80, 0.17, 0.0299], [1, 2, 5]), esc=1e-4),
    "g3_b": lambda: family(mix_cdf([0.70, 0.25, 0.0499], [1, 1.8, 4]), esc=1e-4),
    "g3_c": lambda: family(mix_cdf([0.60, 0.33, 0.0699], [0.8, 1.6, 3.5]), esc=1e-4),
    "t3": lambda: family(t_cdf(3), esc=1e-4),
    "t4": lambda: family(t_cdf(4), esc=1e-4),
    "t6": lambda: family(t_cdf(6), esc=1e-4),
    "t10": lambda: family(t_cdf(10), esc=1e-4),
    "laplace": lambda: family(laplace_cdf, esc=1e-4),
    "logistic": lambda: family(logistic_cdf, esc=1e-4),
    "g2_97_03_w3_e1e-6": lambda: family(mix_cdf([0.97, 0.029999], [1, 3]), esc=1e-6),
    "g2_93_07_w3": lambda: family(mix_cdf([0.93, 0.0699], [1, 3]), esc=1e-4),

}


@functools.lru_cache(None)
def get(name):
    if name.startswith("tnu"):  # tnu<nu>
        return family(t_cdf(float(name[3:])), esc=1e-4)
    return SPECS[name]()
