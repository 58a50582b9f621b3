//! The search for a multi-GPU set: `k` of `n` candidate units with the best sum of pair
//! scores (links between them), ties broken by cost. An exact branch and bound for up to
//! [`EXACT_CANDIDATE_LIMIT`](super::EXACT_CANDIDATE_LIMIT) candidates; beyond that a
//! heuristic, then the exact search within a work budget while the candidates are few
//! enough. Pure, like the rest of placement (its rules: `placement.rs`'s module docs).

use std::cmp::Reverse;

use super::{
    EXACT_CANDIDATE_LIMIT, EXACT_MAX_CANDIDATES, HEURISTIC_WORK_BUDGET, SEARCH_WORK_BUDGET,
};

/// Picks `k` of the `n` candidates (`scores` is `n × n` with a zero diagonal), returning
/// candidate indices in ascending order.
pub(super) fn choose_set(scores: &[u64], costs: &[u128], k: usize) -> Vec<usize> {
    let n = costs.len();
    if k >= n {
        return (0..n).collect();
    }
    if n <= EXACT_CANDIDATE_LIMIT {
        return ExactSearch::run(scores, costs, k, None, u64::MAX);
    }
    let found = heuristic_search(scores, costs, k, HEURISTIC_WORK_BUDGET);
    if n > EXACT_MAX_CANDIDATES {
        return found;
    }
    ExactSearch::run(scores, costs, k, Some(found), SEARCH_WORK_BUDGET)
}

/// Sum of pair scores within `set`.
pub(super) fn set_score(scores: &[u64], n: usize, set: &[usize]) -> u64 {
    let mut total = 0u64;
    for (x, &a) in set.iter().enumerate() {
        for &b in set.iter().skip(x + 1) {
            total = total.saturating_add(scores.get(a * n + b).copied().unwrap_or(0));
        }
    }
    total
}

/// The best set found so far.
#[derive(Debug, Clone)]
struct Best {
    score: u64,
    cost: u128,
    set: Vec<usize>,
    /// Whether the branch and bound met this set itself (then every set it meets later is
    /// lexicographically larger); `false` for a warm start from the heuristic.
    from_search: bool,
}

impl Best {
    /// Whether (score, cost, set) beats `self`: higher score, then lower cost, then the
    /// lexicographically smaller (sorted) set.
    fn beaten_by(&self, score: u64, cost: u128, set: &[usize]) -> bool {
        (Reverse(score), cost, set) < (Reverse(self.score), self.cost, self.set.as_slice())
    }
}

/// Exact branch and bound; see the module docs.
pub(super) struct ExactSearch<'a> {
    n: usize,
    k: usize,
    scores: &'a [u64],
    costs: &'a [u128],
    /// `top[(p·n + j)·k + m]`: sum of the `m` largest scores from `j` to candidates in
    /// `p..n` other than `j`, for `m < k`.
    top: Vec<u64>,
    chosen: Vec<usize>,
    /// `gain[j]`: sum of scores from `j` to the chosen candidates.
    gain: Vec<u64>,
    best: Option<Best>,
    /// Steps spent and allowed.
    work: u64,
    budget: u64,
    /// Scratch for the bound.
    bound_buf: Vec<u64>,
    cost_buf: Vec<u128>,
}

impl<'a> ExactSearch<'a> {
    /// The best `k`-set, exact unless `budget` runs out first (then the best met so far,
    /// `incumbent` included).
    pub(super) fn run(
        scores: &'a [u64],
        costs: &'a [u128],
        k: usize,
        incumbent: Option<Vec<usize>>,
        budget: u64,
    ) -> Vec<usize> {
        let n = costs.len();
        let best = incumbent.map(|set| Best {
            score: set_score(scores, n, &set),
            cost: set
                .iter()
                .fold(0u128, |acc, &i| acc.saturating_add(costs[i])),
            set,
            from_search: false,
        });
        let mut top = vec![0u64; n * n * k];
        let mut row = Vec::with_capacity(n);
        for p in 0..n {
            for j in p..n {
                row.clear();
                row.extend((p..n).filter(|&q| q != j).map(|q| scores[j * n + q]));
                // Only the k − 1 largest matter.
                if k > 1 && row.len() > k - 1 {
                    row.select_nth_unstable_by(k - 2, |a, b| b.cmp(a));
                    row.truncate(k - 1);
                }
                row.sort_unstable_by(|a, b| b.cmp(a));
                let base = (p * n + j) * k;
                let mut sum = 0u64;
                for m in 1..k {
                    sum = sum.saturating_add(row.get(m - 1).copied().unwrap_or(0));
                    top[base + m] = sum;
                }
            }
        }
        let mut search = ExactSearch {
            n,
            k,
            scores,
            costs,
            top,
            chosen: Vec::with_capacity(k),
            gain: vec![0; n],
            best,
            work: 0,
            budget,
            bound_buf: Vec::with_capacity(n),
            cost_buf: Vec::with_capacity(n),
        };
        search.visit(0, 0, 0);
        search.best.map(|b| b.set).unwrap_or_default()
    }

    fn visit(&mut self, next: usize, score: u64, cost: u128) {
        let remaining = self.k - self.chosen.len();
        if remaining == 0 {
            // Sets are met in lexicographic order, so an equal key only replaces a warm start.
            let better = self.best.as_ref().is_none_or(|b| {
                score > b.score
                    || (score == b.score && (cost < b.cost || (cost == b.cost && !b.from_search)))
            });
            if better {
                self.best = Some(Best {
                    score,
                    cost,
                    set: self.chosen.clone(),
                    from_search: true,
                });
            }
            return;
        }
        if self.work >= self.budget {
            return;
        }
        self.work = self
            .work
            .saturating_add(u64::try_from(self.n).unwrap_or(u64::MAX));
        if self.n - next < remaining {
            return;
        }
        if self.cannot_beat(next, remaining, score, cost) {
            return;
        }
        // Include `next`.
        let added = self.gain[next];
        self.chosen.push(next);
        for j in next + 1..self.n {
            self.gain[j] += self.scores[next * self.n + j];
        }
        self.visit(
            next + 1,
            score.saturating_add(added),
            cost.saturating_add(self.costs[next]),
        );
        for j in next + 1..self.n {
            self.gain[j] -= self.scores[next * self.n + j];
        }
        self.chosen.pop();
        // Exclude `next`.
        self.visit(next + 1, score, cost);
    }

    /// Whether no completion of the current partial set (from candidates `next..n`,
    /// `remaining` more) can beat the incumbent (strictly, or also tie it while the
    /// incumbent is a warm start that a lexicographically smaller set may displace).
    fn cannot_beat(&mut self, next: usize, remaining: usize, score: u64, cost: u128) -> bool {
        let Some(best) = &self.best else {
            return false;
        };
        self.bound_buf.clear();
        for j in next..self.n {
            let ahead = self.top[(next * self.n + j) * self.k + (remaining - 1)];
            self.bound_buf
                .push(self.gain[j].saturating_mul(2).saturating_add(ahead));
        }
        let twice_extra = sum_of_largest(&mut self.bound_buf, remaining);
        let bound = score.saturating_add(twice_extra / 2);
        if bound < best.score {
            return true;
        }
        if bound > best.score {
            return false;
        }
        self.cost_buf.clear();
        self.cost_buf.extend_from_slice(&self.costs[next..]);
        let least = cost.saturating_add(sum_of_smallest(&mut self.cost_buf, remaining));
        if best.from_search {
            least >= best.cost
        } else {
            least > best.cost
        }
    }
}

/// Sum of the `r` largest values (reorders `values`).
fn sum_of_largest(values: &mut [u64], r: usize) -> u64 {
    if r == 0 || values.is_empty() {
        return 0;
    }
    let r = r.min(values.len());
    values.select_nth_unstable_by(r - 1, |a, b| b.cmp(a));
    values
        .iter()
        .take(r)
        .fold(0u64, |acc, &v| acc.saturating_add(v))
}

/// Sum of the `r` smallest values (reorders `values`).
fn sum_of_smallest(values: &mut [u128], r: usize) -> u128 {
    if r == 0 || values.is_empty() {
        return 0;
    }
    let r = r.min(values.len());
    values.select_nth_unstable(r - 1);
    values
        .iter()
        .take(r)
        .fold(0u128, |acc, &v| acc.saturating_add(v))
}

/// Bounded search for large machines: greedy growth from each seed (best-connected seeds
/// first), then best-improvement swaps, within `budget` elementary steps. At least one seed
/// is always completed.
pub(super) fn heuristic_search(
    scores: &[u64],
    costs: &[u128],
    k: usize,
    budget: u64,
) -> Vec<usize> {
    let n = costs.len();
    let score_of = |a: usize, b: usize| scores.get(a * n + b).copied().unwrap_or(0);
    let step = |units: usize| u64::try_from(units).unwrap_or(u64::MAX);
    let mut seeds: Vec<usize> = (0..n).collect();
    let reach: Vec<u64> = (0..n)
        .map(|i| (0..n).map(|j| score_of(i, j)).sum())
        .collect();
    seeds.sort_by_key(|&i| (Reverse(reach[i]), i));
    let mut work = step(n * n);
    let mut best: Option<Best> = None;
    for (attempt, &seed) in seeds.iter().enumerate() {
        if attempt > 0 && work >= budget {
            break;
        }
        let mut in_set = vec![false; n];
        let mut gain = vec![0u64; n];
        let add = |x: usize, in_set: &mut Vec<bool>, gain: &mut Vec<u64>| {
            in_set[x] = true;
            for (y, g) in gain.iter_mut().enumerate() {
                *g += score_of(y, x);
            }
        };
        let remove = |x: usize, in_set: &mut Vec<bool>, gain: &mut Vec<u64>| {
            in_set[x] = false;
            for (y, g) in gain.iter_mut().enumerate() {
                *g -= score_of(y, x);
            }
        };
        add(seed, &mut in_set, &mut gain);
        for _ in 1..k {
            let pick = (0..n)
                .filter(|&j| !in_set[j])
                .min_by_key(|&j| (Reverse(gain[j]), costs[j], j));
            let Some(pick) = pick else { break };
            add(pick, &mut in_set, &mut gain);
            work = work.saturating_add(step(2 * n));
        }
        // Best-improvement swaps; each strictly improves (score, cost), so this ends.
        while work < budget {
            // (score delta, out, in); among improving swaps the largest delta wins, then the
            // largest cost saving, then the lowest indices.
            let mut best_swap: Option<(i128, usize, usize)> = None;
            for out in (0..n).filter(|&i| in_set[i]) {
                for inn in (0..n).filter(|&j| !in_set[j]) {
                    let delta = i128::from(gain[inn])
                        - i128::from(score_of(out, inn))
                        - i128::from(gain[out]);
                    if delta < 0 || (delta == 0 && costs[inn] >= costs[out]) {
                        continue;
                    }
                    let better = best_swap.is_none_or(|(d, o, i)| {
                        // Saving of (out, inn) larger than that of (o, i), without negatives.
                        let saves_more = costs[inn].saturating_add(costs[o])
                            < costs[i].saturating_add(costs[out]);
                        delta > d || (delta == d && saves_more)
                    });
                    if better {
                        best_swap = Some((delta, out, inn));
                    }
                }
            }
            work = work.saturating_add(step(n * n));
            let Some((_, out, inn)) = best_swap else {
                break;
            };
            remove(out, &mut in_set, &mut gain);
            add(inn, &mut in_set, &mut gain);
        }
        let set: Vec<usize> = (0..n).filter(|&i| in_set[i]).collect();
        let score = set_score(scores, n, &set);
        let cost = set
            .iter()
            .fold(0u128, |acc, &i| acc.saturating_add(costs[i]));
        if best.as_ref().is_none_or(|b| b.beaten_by(score, cost, &set)) {
            best = Some(Best {
                score,
                cost,
                set,
                from_search: false,
            });
        }
    }
    best.map(|b| b.set).unwrap_or_default()
}
