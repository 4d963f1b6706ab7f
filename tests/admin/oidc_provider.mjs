// A real OpenID Connect provider for the console's single sign-on tests: panva's oidc-provider
// (npm), on loopback, with its development login (any user name, any password) and one client.
// Accounts' claims: <name>@example.com, and groups from the name (alice: proxy-admins, bob: finance,
// dana: ml-leads with the team team_ml in her `teams` claim, anyone else: none). Usage: node provider.mjs PORT REDIRECT_URI CLIENT_ID CLIENT_SECRET
import Provider from 'oidc-provider';

const [port, redirectUri, clientId, clientSecret] = process.argv.slice(2);
const GROUPS = { alice: ['proxy-admins'], bob: ['finance'], dana: ['ml-leads'] };
const TEAMS = { dana: ['team_ml'] };

const provider = new Provider(`http://127.0.0.1:${port}`, {
  clients: [{
    client_id: clientId, client_secret: clientSecret, redirect_uris: [redirectUri],
    grant_types: ['authorization_code'], response_types: ['code'],
    token_endpoint_auth_method: 'client_secret_basic',
  }],
  pkce: { required: () => true },
  claims: { openid: ['sub'], email: ['email'], profile: ['name', 'groups', 'teams'] },
  findAccount: async (ctx, id) => ({
    accountId: id,
    claims: async () => ({ sub: id, email: `${id}@example.com`, name: id, groups: GROUPS[id] || [],
                           teams: TEAMS[id] || [] }),
  }),
  // the groups go in the ID token itself, so the relying party needs no userinfo call
  conformIdTokenClaims: false,
  cookies: { keys: ['a-test-only-cookie-signing-key'] },
  ttl: { AccessToken: 300, AuthorizationCode: 60, IdToken: 300, Interaction: 300, Session: 600, Grant: 600 },
  loadExistingGrant: async (ctx) => {
    // consent is given at once: the test is about the relying party, not the consent screen
    const grant = new ctx.oidc.provider.Grant({ clientId: ctx.oidc.client.clientId, accountId: ctx.oidc.session.accountId });
    grant.addOIDCScope('openid email profile');
    await grant.save();
    return grant;
  },
});
provider.proxy = false;
provider.listen(Number(port), '127.0.0.1', () => console.log(`oidc provider listening on ${port}`));
