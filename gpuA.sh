set -x
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name --format=csv
case "$1" in
tests)
  timeout 420 python3 -m pytest -m gpu tests -n 8 -q -p no:cacheprovider -x 2>&1 | tail -25 | tee $OUT/gpu_tests.txt
  timeout 150 compute-sanitizer --tool racecheck --print-limit 5 python3 benches/sanitize_scenarios.py families 2>&1 | tail -5 | tee $OUT/race.txt
  ;;
models)
  timeout 560 python3 benches/models.py --out $OUT/models 2>&1 | tail -45 | tee $OUT/models.txt
  ;;
long)
  timeout 560 python3 benches/long_rows.py --runs 3 2>&1 | tail -40 | tee $OUT/long.txt
  ;;
esac
case "$1" in
hand)
  timeout 400 python3 exp_hand.py --runs 5 2>&1 | tee $OUT/hand.txt | tail -60
  timeout 150 python3 benches/long_rows.py --runs 5 --only softmax,rmsnorm 65536 131072 262144 2>&1 | tail -8
  ;;
esac
case "$1" in
var)
  timeout 500 python3 exp_var.py 2>&1 | tee $OUT/var.txt
  ;;
esac
case "$1" in
launch)
  timeout 300 python3 exp_launch.py 2>&1 | tee $OUT/launch.txt
  ;;
esac
case "$1" in
launch2)
  timeout 400 python3 exp_launch2.py 2>&1 | tee $OUT/launch2.txt
  ;;
esac
case "$1" in
dump)
  python3 exp_dump.py; ls $OUT
  ;;
esac
case "$1" in
ab)
  rm -rf /tmp/siteold && python3 -m pip install -q --no-index --no-deps --target /tmp/siteold .whlold/*.whl
  for r in 1 2; do
    for w in old new; do
      if [ $w = old ]; then P=/tmp/siteold; else P=/tmp/site; fi
      echo "== $w round $r"
      PYTHONPATH=$P timeout 200 python3 benches/long_rows.py --runs 5 --only softmax,cross_entropy 16384 65536 131072 262144 2>&1 | grep -A3 "kiln / copy"
    done
  done 2>&1 | tee $OUT/ab.txt
  ;;
esac
case "$1" in
launch3)
  timeout 300 python3 exp_launch3.py 2>&1 | tee $OUT/launch3.txt
  ;;
esac
case "$1" in
opts)
  timeout 300 python3 exp_opts.py 2>&1 | tee $OUT/opts.txt
  ;;
esac
case "$1" in
lse)
  rm -rf /tmp/siteold && python3 -m pip install -q --no-index --no-deps --target /tmp/siteold .whlold/*.whl
  timeout 200 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests/test_masked_rows.py tests/test_cluster_rows.py tests/test_online_reductions.py tests/test_families.py 2>&1 | tail -4 | tee $OUT/lse_tests.txt
  for w in old new old new; do
    if [ $w = old ]; then P=/tmp/siteold; else P=/tmp/site; fi
    echo "== $w"
    PYTHONPATH=$P timeout 100 python3 benches/long_rows.py --runs 5 --only softmax,cross_entropy 65536 131072 262144 2>&1 | grep -A3 "kiln / copy"
  done 2>&1 | tee $OUT/lse_ab.txt
  for w in old new; do
    if [ $w = old ]; then P=/tmp/siteold; else P=/tmp/site; fi
    echo "== $w"
    PYTHONPATH=$P timeout 150 python3 benches/models.py --quick --only log_softmax_128256 log_softmax_32000 cross_entropy_128256 bert_attention_softmax --out /tmp/m_$w 2>&1 | tail -6
  done 2>&1 | tee $OUT/lse_models.txt
  ;;
esac
case "$1" in
mask)
  rm -rf /tmp/siteold && python3 -m pip install -q --no-index --no-deps --target /tmp/siteold .whlold/*.whl
  timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_masked_rows.py -x -k "fully_masked and 1e+30 and False" 2>&1 | grep -v "^  " | tail -30
  PYTHONPATH=/tmp/siteold timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_masked_rows.py -k "fully_masked" 2>&1 | tail -14
  ;;
esac
case "$1" in
mask2)
  timeout 150 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests/test_masked_rows.py tests/test_online_reductions.py tests/test_cluster_rows.py 2>&1 | tail -4
  ;;
esac
case "$1" in
s2)
  timeout 300 python3 -m pytest -m gpu tests -n 8 -q -p no:cacheprovider -x 2>&1 | tail -6 | tee $OUT/gpu_tests.txt
  timeout 120 compute-sanitizer --tool racecheck --print-limit 5 python3 benches/sanitize_scenarios.py families 2>&1 | tail -3 | tee $OUT/race.txt
  timeout 150 python3 benches/models.py --only gpt2_embedding gpt2_embedding_batched layernorm2d_timm --out $OUT/models 2>&1 | tail -12 | tee $OUT/models.txt
  ;;
esac
