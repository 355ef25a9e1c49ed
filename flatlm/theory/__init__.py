"""Theory checks: `dyck` is the exact numerical check of Section 6 / Theorem 6.1 (the flattest zero-loss
single-layer transformer on masked Dyck learns the transferable feature), with its traces in `dyck_trace`, its SGD
steps, Tr(H) penalty and label noise in `dyck_train`, the Tr(H)-minimisation search over the zero-loss set in
`dyck_search`, label-noise SGD from a zero-loss start in `dyck_noise`, and the plots in `plot`; `flatlm.cli.theory`
registers `flatlm theory ...`."""
