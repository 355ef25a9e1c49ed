"""Theory checks: `dyck` is the exact numerical check of Section 6 / Theorem 6.1 (the flattest zero-loss
single-layer transformer on masked Dyck learns the transferable feature), with its SGD steps and Tr(H) penalty in
`dyck_train`; `cli` registers `flatlm theory ...`."""
