"""The table of xla_flag_sweep.sh's output folder: python docs/results/scripts/xla_flag_table.py OUT_DIR."""
import glob
import os
import re
import sys

NAMES = ['xla-default', 'xla-xnnpack', 'xla-onednn', 'xla-xnn-graph-greedy', 'xla-eigen-1-thread',
         'xla-no-tiled-emitter', 'xla-1-core', 'skinny', 'skinny-1-core']


def rows(path):
  """{(k or tree): (greedy ms, iteration ms, ratio)} of one bench_decode output, or the error's last line."""
  text = open(path).read()
  if 'rc=0' not in text:
    return re.findall(r'^.*(?:Unknown flag|Error|error).*$', text, re.M)[-1:] or ['failed']
  out = {}
  for line in text.splitlines():
    cells = [c.strip() for c in line.strip('|').split('|')]
    if len(cells) > 6 and cells[0] in ('4', '8') and cells[1] == '1':
      out[f'k={cells[0]}'] = (float(cells[3]), float(cells[4]), float(cells[5]))
    elif len(cells) == 6 and cells[0].startswith('dynamic'):
      out[cells[0]] = (float(cells[2]), float(cells[3]), float(cells[4]))
  return out


def main(folder):
  base_greedy = {}
  print('| setting | small: greedy step (ms) | k = 4 | k = 8 | dynamic:16, k = 8 | base: greedy step (ms) | k = 4 '
        '| k = 8 |')
  print('|---|---|---|---|---|---|---|---|')
  for name in NAMES:
    cells = [name]
    for size, keys in (('small', ('k=4', 'k=8', 'dynamic:16 k=8')), ('base', ('k=4', 'k=8'))):
      path = os.path.join(folder, f'{name}.{size}.txt')
      if not os.path.exists(path):
        cells += ['-'] * (len(keys) + 1)
        continue
      r = rows(path)
      if isinstance(r, list):
        cells += [f'fails: `{r[0].strip()[-70:]}`'] + [''] * len(keys)
        continue
      greedy = r['k=4'][0]
      base_greedy.setdefault(size, greedy)
      cells.append(f'{greedy:.2f} ({greedy / base_greedy[size]:.2f}x default)')
      for key in keys:
        g, it, ratio = r[key]
        cells.append(f'{ratio:.2f} ({it / base_greedy[size]:.2f})')
    print('| ' + ' | '.join(cells) + ' |')


if __name__ == '__main__':
  main(sys.argv[1])
